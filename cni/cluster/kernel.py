"""The cluster network's netlink edge: the VXLAN device, and reading and writing what the agent owns.

What the agent owns, so that it can find it again after a restart and never touches anything else:

- routes in the main table carrying its route protocol number (``cni.cluster.route_protocol``, default 110; ``ip
  route show proto 110``); a route of another protocol to the same destination is left alone and reported;
- the VXLAN device (``nodeplug.vx``) and every permanent FDB and neighbour entry on it.

The device is kept across restarts: when it exists with the configured VNI, port, local address and underlay
interface it is used as it is (its MAC, which peers have programmed, never changes); its MAC is derived from the
node name and VNI, so even a device created anew (after a reboot) has the MAC the Node's annotation already names.
Only a changed VXLAN config recreates it.

Every call runs on one thread (the caller's), over one :class:`~cni.dataplane.rtnl.Rtnl` socket in that thread's
network namespace. Kernel refusals become :class:`KernelError` naming the entry and the kernel's reason.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any, NamedTuple

from cni.cluster import offload, rawnl
from cni.cluster.model import IPAddress, IPNetwork
from cni.cluster.plan import Changes, RouteSpec, State
from cni.dataplane.messages import AddrMsg, LinkMsg, NeighMsg, RouteMsg
from cni.dataplane.nl import IFF_UP, create_link, delete_link, get_link, link_kind, linkinfo, links, set_link
from cni.dataplane.nlwire import NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE
from cni.dataplane.rtnl import (
    RTM_DELNEIGH,
    RTM_DELROUTE,
    RTM_GETADDR,
    RTM_GETNEIGH,
    RTM_GETROUTE,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
    NetlinkError,
    Rtnl,
)

VXLAN_DEVICE = "nodeplug.vx"
RT_TABLE_MAIN = 254
RTN_UNICAST = 1
RTNH_F_ONLINK = 4
NUD_PERMANENT = 0x80
NTF_SELF = 0x02
VXLAN_OVERHEAD = {4: 50, 6: 70}  # outer IP + UDP + VXLAN + inner Ethernet headers
RTM_F_FIB_MATCH = 0x2000  # a route lookup answers with the matching FIB entry (protocol and prefix included)


class KernelError(Exception):
    """A netlink request failed; the message names the entry and the kernel's reason."""


class Underlay(NamedTuple):
    ifindex: int
    name: str
    mtu: int


class VxlanDevice(NamedTuple):
    ifindex: int
    mac: str
    mtu: int
    created: bool  # made now (False: an existing device was kept as it was)


def _reason(e: BaseException) -> str:
    if isinstance(e, NetlinkError):
        return str(e.args[1]) if len(e.args) > 1 and e.args[1] else str(e)
    return str(e)


def vtep_mac(node: str, vni: int) -> str:
    """A locally administered unicast MAC that depends only on the node's name and the VNI."""
    b = bytearray(hashlib.sha256(f"nodeplug vtep {node} {vni}".encode()).digest()[:6])
    b[0] = (b[0] & 0xFE) | 0x02
    return ":".join(f"{x:02x}" for x in b)


def _family(version: int) -> int:
    return socket.AF_INET if version == 4 else socket.AF_INET6


# ---------------------------------------------------------------- interfaces and addresses


def addresses(nl: Rtnl) -> list[tuple[int, ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    """(link index, address/prefix) of every address in the socket's netns."""
    out = []
    for msg in nl.dump(AddrMsg(), RTM_GETADDR, AddrMsg):
        a = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
        if a:
            out.append((int(msg["index"]), ipaddress.ip_interface(f"{a}/{msg['prefixlen']}")))
    return out


def underlay_of(nl: Rtnl, address: IPAddress, name: str = "") -> Underlay:
    """The interface carrying ``address`` (or the one named ``name``), with its MTU."""
    by_index = {int(m["index"]): m for m in links(nl)}
    if name:
        found = next((i for i, m in by_index.items() if m.get("IFLA_IFNAME") == name), None)
        if found is None:
            raise KernelError(f"vxlan.underlay: no interface named {name}")
    else:
        found = next((i for i, a in addresses(nl) if a.ip == address), None)
        if found is None:
            raise KernelError(f"no interface carries this node's InternalIP {address}")
    m = by_index[found]
    return Underlay(found, str(m.get("IFLA_IFNAME")), int(m.get("IFLA_MTU") or 1500))


def connected(nl: Rtnl, exclude: Iterable[IPNetwork], skip_index: Iterable[int] = ()) -> list[IPNetwork]:
    """The subnets this node is directly on: its addresses' prefixes, without loopback, link-local, the pod
    networks in ``exclude`` and the links in ``skip_index``."""
    skip = set(skip_index)
    out: list[IPNetwork] = []
    for index, iface in addresses(nl):
        net = iface.network
        if index in skip or iface.ip.is_loopback or iface.ip.is_link_local or net.prefixlen == net.max_prefixlen:
            continue
        if any(net.version == x.version and net.overlaps(x) for x in exclude):
            continue
        if net not in out:
            out.append(net)
    return out


def default_gateways(nl: Rtnl) -> list[IPAddress]:
    """The gateways of the main table's default routes, whoever owns them (the node's way out)."""
    out: list[IPAddress] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for data in nl.dump_raw(RouteMsg(family=family), RTM_GETROUTE):
            r = rawnl.route(data)
            if r is not None and r.table == RT_TABLE_MAIN and r.dst_len == 0 and r.gateway and r.gateway not in out:
                out.append(r.gateway)
    return out


class RoutePath(NamedTuple):
    """The main-table route the kernel uses for a destination."""

    dst: IPNetwork
    protocol: int
    gateway: IPAddress | None


def path_to(nl: Rtnl, address: IPAddress) -> RoutePath | None:
    """The route the kernel would take to ``address`` (None: unreachable, or a route of another table)."""
    req = RouteMsg(family=_family(address.version), dst_len=address.max_prefixlen, flags=RTM_F_FIB_MATCH)
    req["attrs"] = [("RTA_DST", str(address))]
    try:
        msg = nl.get(req, RTM_GETROUTE, RouteMsg)
    except NetlinkError:
        return None
    table = msg.get("RTA_TABLE") or msg["table"]
    if table != RT_TABLE_MAIN:
        return None
    dst_text = msg.get("RTA_DST") or ("0.0.0.0" if address.version == 4 else "::")
    gw = msg.get("RTA_GATEWAY")
    return RoutePath(
        ipaddress.ip_network(f"{dst_text}/{msg['dst_len']}", strict=False),
        int(msg["proto"]),
        ipaddress.ip_address(gw) if gw else None,
    )


# ---------------------------------------------------------------- the VXLAN device


def _vxlan_data(vni: int, port: int, local: IPAddress, underlay: int) -> list[tuple[str, Any]]:
    return [
        ("IFLA_VXLAN_ID", vni),
        ("IFLA_VXLAN_LOCAL" if local.version == 4 else "IFLA_VXLAN_LOCAL6", str(local)),
        ("IFLA_VXLAN_LINK", underlay),
        ("IFLA_VXLAN_PORT", port),
        ("IFLA_VXLAN_LEARNING", 0),
    ]


def _matches(msg: LinkMsg, vni: int, port: int, local: IPAddress, underlay: int) -> bool:
    if link_kind(msg) != "vxlan":
        return False
    data = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA")
    if data is None:
        return False
    got_local = data.get("IFLA_VXLAN_LOCAL" if local.version == 4 else "IFLA_VXLAN_LOCAL6")
    return (
        data.get("IFLA_VXLAN_ID") == vni
        and data.get("IFLA_VXLAN_PORT") == port
        and got_local is not None
        and ipaddress.ip_address(got_local) == local
        and data.get("IFLA_VXLAN_LINK") == underlay
        and not data.get("IFLA_VXLAN_LEARNING")
    )


def ensure_vxlan(
    nl: Rtnl,
    node: str,
    vni: int,
    port: int,
    local: IPAddress,
    underlay: Underlay,
    name: str = VXLAN_DEVICE,
    tx_checksum_offload: bool = False,
) -> VxlanDevice:
    """The VXLAN device, up, with MTU = underlay MTU - overhead and transmit checksum offload as asked
    (:mod:`cni.cluster.offload`); kept as it is when it already matches."""
    mtu = underlay.mtu - VXLAN_OVERHEAD[local.version]
    msg = get_link(nl, name)
    created = False
    if msg is not None and link_kind(msg) != "vxlan":
        raise KernelError(f"{name} exists and is a {link_kind(msg) or 'non-VXLAN'} device, not nodeplug's: left alone")
    if msg is not None and not _matches(msg, vni, port, local, underlay.ifindex):
        try:
            delete_link(nl, name)
        except NetlinkError as e:
            raise KernelError(f"remove {name} (its VXLAN settings changed): {_reason(e)}") from None
        msg = None
    if msg is None:
        attrs = [
            ("IFLA_IFNAME", name),
            ("IFLA_ADDRESS", vtep_mac(node, vni)),
            ("IFLA_MTU", mtu),
            linkinfo("vxlan", _vxlan_data(vni, port, local, underlay.ifindex)),
        ]
        try:
            create_link(nl, attrs)
        except NetlinkError as e:
            raise KernelError(
                f"create VXLAN device {name} (VNI {vni}, port {port}, local {local}): {_reason(e)}"
            ) from None
        msg = get_link(nl, name)
        if msg is None:
            raise KernelError(f"VXLAN device {name} vanished right after it was created")
        created = True
    index = int(msg["index"])
    if int(msg.get("IFLA_MTU") or 0) != mtu:
        try:
            set_link(nl, index, [("IFLA_MTU", mtu)])
        except NetlinkError as e:
            raise KernelError(f"set the MTU of {name} to {mtu}: {_reason(e)}") from None
    try:
        offload.ensure_tx_checksum(name, tx_checksum_offload)
    except offload.OffloadError as e:
        raise KernelError(str(e)) from None
    if not int(msg["flags"]) & IFF_UP:
        try:
            set_link(nl, index, flags=IFF_UP, change=IFF_UP)
        except NetlinkError as e:
            raise KernelError(f"bring {name} up: {_reason(e)}") from None
    return VxlanDevice(index, str(msg.get("IFLA_ADDRESS")), mtu, created)


def remove_vxlan(nl: Rtnl, name: str = VXLAN_DEVICE) -> bool:
    """Delete the device (and with it every FDB and neighbour entry on it); False when there was none (or a link of
    that name is not a VXLAN device: not nodeplug's, left alone)."""
    if vxlan_index(nl, name) is None:
        return False
    try:
        delete_link(nl, name)
    except NetlinkError as e:
        if e.code == errno.ENODEV:
            return False
        raise KernelError(f"remove {name}: {_reason(e)}") from None
    return True


def vxlan_index(nl: Rtnl, name: str = VXLAN_DEVICE) -> int | None:
    msg = get_link(nl, name)
    return int(msg["index"]) if msg is not None and link_kind(msg) == "vxlan" else None


# ---------------------------------------------------------------- reading what we own


class Owned(NamedTuple):
    state: State
    foreign: set[IPNetwork]  # destinations with a route of another protocol in the main table


def read_owned(nl: Rtnl, protocol: int, vx_index: int | None) -> Owned:
    """Our routes (protocol ``protocol``, main table) and the FDB and neighbour entries on the VXLAN device."""
    state = State.empty()
    foreign: set[IPNetwork] = set()
    for family in (socket.AF_INET, socket.AF_INET6):
        for data in nl.dump_raw(RouteMsg(family=family), RTM_GETROUTE):
            r = rawnl.route(data)
            if r is None or r.table != RT_TABLE_MAIN or r.type != RTN_UNICAST or r.dst is None:
                continue
            dst = ipaddress.ip_network(f"{r.dst}/{r.dst_len}", strict=False)
            if r.protocol != protocol:
                foreign.add(dst)
                continue
            if r.gateway is None:
                continue  # not a shape we make: deleted by the next diff (it is ours)
            state.routes[dst] = RouteSpec(dst, r.gateway, r.oif == vx_index)
    if vx_index is not None:
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_BRIDGE):
            for data in nl.dump_raw(NeighMsg(family=family), RTM_GETNEIGH):
                n = rawnl.neighbour(data)
                if n is None or n.ifindex != vx_index or not n.state & NUD_PERMANENT or not n.lladdr or not n.dst:
                    continue
                if family == socket.AF_BRIDGE:
                    if n.lladdr != "00:00:00:00:00:00":
                        state.fdb[n.lladdr] = n.dst
                else:
                    state.neigh[n.dst] = n.lladdr
    return Owned(state, foreign)


# ---------------------------------------------------------------- writing


def _route_msg(r: RouteSpec, protocol: int, vx_index: int | None) -> RouteMsg:
    msg = RouteMsg(
        family=_family(r.dst.version), dst_len=r.dst.prefixlen, table=RT_TABLE_MAIN, proto=protocol, type=RTN_UNICAST
    )
    attrs: list[tuple[str, Any]] = [("RTA_DST", str(r.dst.network_address)), ("RTA_GATEWAY", str(r.gateway))]
    if r.vxlan:
        if vx_index is None:
            raise KernelError(f"route to {r.dst}: no VXLAN device")
        msg["flags"] = RTNH_F_ONLINK
        attrs.append(("RTA_OIF", vx_index))
    msg["attrs"] = attrs
    return msg


def _neigh_msg(family: int, index: int, dst: IPAddress, mac: str, fdb: bool) -> NeighMsg:
    msg = NeighMsg(family=family, ifindex=index, state=NUD_PERMANENT, flags=NTF_SELF if fdb else 0)
    msg["attrs"] = [("NDA_DST", str(dst)), ("NDA_LLADDR", mac)]
    return msg


def set_route(nl: Rtnl, r: RouteSpec, protocol: int, vx_index: int | None, old: RouteSpec | None = None) -> None:
    """Add ``r``; ``old``: ours already exists for its destination and differs, so it is replaced.

    The kernel refuses some replaces outright: an IPv6 route moving from the underlay to an on-link next hop on the
    VXLAN device ("Nexthop has invalid gateway or device mismatch": the new next hop lies inside the prefix whose
    old route goes out another device). Then the old route is deleted and the new one added at once (the
    destination is unrouted for the time of two netlink requests); if the add still fails, the old route is put
    back, so a peer is never left without a path because its new one is refused."""
    if old is None:
        try:
            nl.ack(_route_msg(r, protocol, vx_index), RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL)
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                raise KernelError(
                    f"route to {r.dst}: a route nodeplug does not own exists for it; left alone"
                ) from None
            raise KernelError(f"route to {r.dst} via {r.gateway}: {_reason(e)}") from None
        return
    try:
        nl.ack(_route_msg(r, protocol, vx_index), RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE)
        return
    except NetlinkError as e:
        refused = _reason(e)
    del_route(nl, old, protocol, vx_index)
    try:
        nl.ack(_route_msg(r, protocol, vx_index), RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL)
    except NetlinkError as e:
        try:
            nl.ack(_route_msg(old, protocol, vx_index), RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL)
        except NetlinkError as back:
            raise KernelError(
                f"route to {r.dst} via {r.gateway}: refused ({refused}, then {_reason(e)}), and its old route via "
                f"{old.gateway} could not be put back ({_reason(back)}): unrouted"
            ) from None
        raise KernelError(
            f"route to {r.dst} via {r.gateway}: refused ({refused}, then {_reason(e)}); it keeps its old route via "
            f"{old.gateway}"
        ) from None


def del_route(nl: Rtnl, r: RouteSpec, protocol: int, vx_index: int | None) -> None:
    msg = _route_msg(r._replace(vxlan=False), protocol, None)  # matched by destination, table and our protocol
    msg["attrs"] = [("RTA_DST", str(r.dst.network_address))]
    try:
        nl.ack(msg, RTM_DELROUTE)
    except NetlinkError as e:
        if e.code not in (errno.ESRCH, errno.ENOENT):
            raise KernelError(f"delete route to {r.dst}: {_reason(e)}") from None


class Applied(NamedTuple):
    """What :func:`apply` did: how many changes landed, and each that did not (its destination when it was a
    route, and why)."""

    done: int
    failed: list[tuple[IPNetwork | None, str]]


def apply(nl: Rtnl, ch: Changes, have: State, protocol: int, vx_index: int | None) -> Applied:
    """Carry out ``ch`` (neighbours before the routes that use them; routes deleted before their neighbours) and
    update ``have`` to match what was done. Every change is tried; each failure is reported, none is counted done."""
    failed: list[tuple[IPNetwork | None, str]] = []
    done = 0

    def attempt(what: str, fn: Any, *args: Any, dst: IPNetwork | None = None) -> bool:
        nonlocal done
        try:
            fn(*args)
            done += 1
            return True
        except KernelError as e:
            failed.append((dst, str(e)))
        except NetlinkError as e:
            failed.append((dst, f"{what}: {_reason(e)}"))
        return False

    for mac, under in ch.fdb_set:
        if vx_index is not None and attempt(
            f"FDB {mac}", nl.ack, _neigh_msg(socket.AF_BRIDGE, vx_index, under, mac, True), RTM_NEWNEIGH,
            NLM_F_CREATE | NLM_F_REPLACE,
        ):  # fmt: skip
            have.fdb[mac] = under
    for hop, mac in ch.neigh_set:
        if vx_index is not None and attempt(
            f"neighbour {hop}", nl.ack, _neigh_msg(_family(hop.version), vx_index, hop, mac, False), RTM_NEWNEIGH,
            NLM_F_CREATE | NLM_F_REPLACE,
        ):  # fmt: skip
            have.neigh[hop] = mac
    for r in ch.routes_set:
        if attempt(f"route {r.dst}", set_route, nl, r, protocol, vx_index, have.routes.get(r.dst), dst=r.dst):
            have.routes[r.dst] = r
    for r in ch.routes_del:
        if attempt(f"route {r.dst}", del_route, nl, r, protocol, vx_index, dst=r.dst):
            have.routes.pop(r.dst, None)
    for hop, mac in ch.neigh_del:
        if vx_index is None or attempt(
            f"delete neighbour {hop}", _del_neigh, nl, _neigh_msg(_family(hop.version), vx_index, hop, mac, False)
        ):
            have.neigh.pop(hop, None)
    for mac, under in ch.fdb_del:
        if vx_index is None or attempt(
            f"delete FDB entry {mac}", _del_neigh, nl, _neigh_msg(socket.AF_BRIDGE, vx_index, under, mac, True)
        ):
            have.fdb.pop(mac, None)
    return Applied(done, failed)


def _del_neigh(nl: Rtnl, msg: NeighMsg) -> None:
    try:
        nl.ack(msg, RTM_DELNEIGH)
    except NetlinkError as e:
        if e.code not in (errno.ENOENT, errno.ESRCH, errno.ENODEV):
            raise
