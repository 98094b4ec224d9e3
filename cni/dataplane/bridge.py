"""The host bridge: created when missing, brought up, given its gateway addresses.

The bridge is shared by every pod of the network and by concurrent ADDs, so everything here is idempotent and
tolerates losing a race (EEXIST from a parallel creation or address add is success). It is never removed by a failed
ADD: other pods may already use it.

Behaviour follows the reference ``bridge`` plugin:

- created with ``mtu`` and a fixed random MAC (a bridge without a set MAC takes the lowest of its ports', so the pods'
  gateway neighbour entry would go stale whenever a port comes or goes);
- ``promiscMode`` sets IFF_PROMISC; ``vlan`` turns on VLAN filtering and, with ``isGateway``, makes the VLAN the
  bridge's own PVID so the gateway addresses are reachable from the VLAN (the reference plugin puts them on a
  ``<bridge>.<vlan>`` 802.1Q link instead; that needs CONFIG_VLAN_8021Q, this does not);
- ``isGateway``: each IPConfig's gateway, with the address's prefix, is put on the bridge (IPv6 without DAD). Without
  ``forceAddress`` another IPv4 address (or an overlapping IPv6 one) on the bridge is an error naming both; with it,
  that address is replaced.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
from collections.abc import Sequence
from typing import Any

from cni.dataplane.names import BRIDGE_ALIAS
from cni.dataplane.nl import (
    IFF_PROMISC,
    IFF_UP,
    Attr,
    NetlinkError,
    Rtnl,
    add_addr,
    addresses,
    create_link,
    del_addr,
    get_link,
    link_kind,
    linkinfo,
    nl_error,
    random_mac,
    set_link,
)
from cni.dataplane.tools import ToolError, run_tool
from cni.errors import DATAPLANE, CniError
from cni.netconf import BridgeConf
from cni.types import Interface, IPConfig

IPIface = ipaddress.IPv4Interface | ipaddress.IPv6Interface


def ensure_bridge(nl: Rtnl, conf: BridgeConf, ips: Sequence[IPConfig]) -> tuple[int, Interface]:
    """Make sure the bridge exists, is up and carries the gateways; return its index and result interface."""
    name = conf.bridge
    msg = get_link(nl, name)
    if msg is None:
        attrs: list[Attr] = [("IFLA_IFNAME", name), ("IFLA_ADDRESS", random_mac()), linkinfo("bridge")]
        if conf.mtu:
            attrs.append(("IFLA_MTU", conf.mtu))
        created = True
        try:
            create_link(nl, attrs)
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise nl_error(f"create bridge {name}", e) from None
            created = False  # a concurrent ADD made it
        msg = get_link(nl, name)
        if msg is None:
            raise CniError(DATAPLANE, details=f"bridge {name} vanished right after it was created")
        if created:
            try:  # marks it as nodeplug's, for the uninstall (set after creation: a new link takes no alias)
                set_link(nl, int(msg["index"]), [("IFLA_IFALIAS", BRIDGE_ALIAS)])
            except NetlinkError as e:
                raise nl_error(f"mark bridge {name} as nodeplug's", e) from None
    kind = link_kind(msg)
    if kind != "bridge":
        raise CniError(
            DATAPLANE, details=f"bridge {name}: a link of that name exists but is a {kind or 'non-bridge'} device"
        )
    index = int(msg["index"])
    flags = int(msg["flags"])
    want = IFF_UP | (IFF_PROMISC if conf.promisc_mode else 0)
    if flags & want != want:
        try:
            set_link(nl, index, flags=want, change=want)
        except NetlinkError as e:
            raise nl_error(f"bring bridge {name} up", e) from None
    if conf.vlan:
        _ensure_vlan_filtering(nl, name, index, msg)
        if conf.is_gateway:
            _bridge_self_in_vlan(name, conf.vlan)
    if conf.is_gateway:
        for gw in gateway_addresses(ips):
            _ensure_addr(nl, name, index, gw, conf.force_address)
    return index, Interface(name=name, mac=str(msg.get("IFLA_ADDRESS") or ""))


def gateway_addresses(ips: Sequence[IPConfig]) -> list[IPIface]:
    """One gateway per family (the first IPConfig of the family that names one), with that address's prefix."""
    out: dict[int, IPIface] = {}
    for ip in ips:
        if ip.gateway is not None and ip.version not in out:
            out[ip.version] = ipaddress.ip_interface(f"{ip.gateway}/{ip.address.network.prefixlen}")
    return list(out.values())


def _ensure_addr(nl: Rtnl, name: str, index: int, gw: IPIface, force: bool) -> None:
    """Put ``gw`` on the bridge. It is added first (one request; EEXIST, the usual case, means an earlier ADD put it
    there); only a newly added gateway is compared with the bridge's other addresses of its family."""
    try:
        add_addr(nl, index, gw)
    except NetlinkError as e:
        if e.code == errno.EEXIST:
            return
        raise nl_error(f"add gateway address {gw} to bridge {name}", e) from None
    conflicts = [
        a
        for a in addresses(nl, index)
        if a.version == gw.version
        and not a.ip.is_link_local
        and a != gw
        and (gw.version == 4 or gw.ip in a.network or a.ip in gw.network)
    ]
    if conflicts and not force:
        with contextlib.suppress(NetlinkError):
            del_addr(nl, index, gw)
        raise CniError(
            DATAPLANE,
            details=f"bridge {name} already has the address {conflicts[0]}, different from gateway {gw} "
            "(set forceAddress to replace it)",
        )
    for a in conflicts:
        try:
            del_addr(nl, index, a)
        except NetlinkError as e:
            if e.code != errno.EADDRNOTAVAIL:
                raise nl_error(f"remove address {a} from bridge {name}", e) from None


def _ensure_vlan_filtering(nl: Rtnl, name: str, index: int, msg: Any) -> None:
    data = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA")
    if data is not None and data.get("IFLA_BR_VLAN_FILTERING"):
        return
    try:
        set_link(nl, index, [linkinfo("bridge", [("IFLA_BR_VLAN_FILTERING", 1)])])
    except NetlinkError as e:
        if e.code == errno.EOPNOTSUPP:
            raise CniError(
                DATAPLANE,
                details=f"vlan: bridge {name} cannot filter VLANs: the kernel was built without "
                "CONFIG_BRIDGE_VLAN_FILTERING",
            ) from None
        raise nl_error(f"turn on VLAN filtering on bridge {name}", e) from None


def _bridge_self_in_vlan(name: str, vlan: int) -> None:
    """With VLAN filtering the bridge's own addresses (the gateways) live in its PVID: make that ``vlan``, untagged,
    so the pods of the VLAN reach them. (One gateway VLAN per bridge; idempotent.)"""
    try:
        run_tool(["bridge", "vlan", "add", "vid", str(vlan), "dev", name, "self", "pvid", "untagged"], timeout=10)
    except ToolError as e:
        raise e.cni_error(f"vlan: put bridge {name} itself into VLAN {vlan}") from None
