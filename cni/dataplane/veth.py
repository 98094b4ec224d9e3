"""The veth pair: host end on the bridge (or, routed, on its own), the other end created directly inside the pod's
netns as ``ifname``.

Creating the peer in the target netns under its final name (VETH_INFO_PEER with IFLA_NET_NS_FD) is one atomic netlink
request: when ``ifname`` is already taken in the pod, the kernel refuses it and nothing is left on either side, and
there is no temporary name to rename. The host end gets its deterministic name (:func:`names.host_veth_name`), the
bridge as master, the MTU, and an alias marking it as ours; hairpin and the VLAN go on the bridge port.

Deleting the host end deletes the pair, so DEL never needs the pod's netns.
"""

from __future__ import annotations

import errno
import socket

from cni.dataplane.nl import (
    IFF_UP,
    Attr,
    NetlinkError,
    Rtnl,
    add_port_vlan,
    create_link,
    del_port_vlan,
    delete_link,
    get_link,
    linkinfo,
    nl_error,
    random_mac,
    set_link,
)
from cni.errors import DATAPLANE, CniError
from cni.netconf import BridgeConf
from cni.types import Interface


def create_pair(
    nl: Rtnl, conf: BridgeConf, bridge_index: int | None, host_name: str, nsfd: int, netns: str, ifname: str
) -> tuple[Interface, Interface]:
    """Create the pair (both ends down, the host end on the bridge ``bridge_index``, if any); return the host end's
    and the pod end's result interfaces. Both MACs are chosen here (random, locally administered, as the kernel would)
    so nobody has to ask the kernel for them afterwards."""
    host_mac, pod_mac = random_mac(), random_mac()
    peer: list[Attr] = [("IFLA_IFNAME", ifname), ("IFLA_NET_NS_FD", nsfd), ("IFLA_ADDRESS", pod_mac)]
    attrs: list[Attr] = [("IFLA_IFNAME", host_name), ("IFLA_ADDRESS", host_mac)]
    if bridge_index is not None:
        attrs.append(("IFLA_MASTER", bridge_index))
    if conf.mtu:
        attrs.append(("IFLA_MTU", conf.mtu))
        peer.append(("IFLA_MTU", conf.mtu))
    attrs.append(linkinfo("veth", [("VETH_INFO_PEER", {"attrs": peer})]))
    try:
        create_link(nl, attrs)
    except NetlinkError as e:
        if e.code == errno.EEXIST:
            if get_link(nl, host_name) is not None:
                raise CniError(
                    DATAPLANE,
                    details=f"host interface {host_name} for this container and ifname {ifname} already exists: "
                    "the attachment is already set up (DEL it first)",
                ) from None
            raise CniError(
                DATAPLANE, details=f"interface {ifname} already exists in the network namespace {netns}"
            ) from None
        raise nl_error(f"create veth pair {host_name} / {ifname}", e) from None
    return Interface(name=host_name, mac=host_mac), Interface(name=ifname, mac=pod_mac, sandbox=netns)


def index_of(name: str) -> int:
    """The index of link ``name`` in the calling thread's netns (an ioctl, no netlink round trip)."""
    try:
        return socket.if_nametoindex(name)
    except OSError as e:
        raise CniError(DATAPLANE, details=f"interface {name} vanished right after it was created: {e}") from None


def configure_host_port(nl: Rtnl, conf: BridgeConf, host_name: str, alias: str) -> None:
    """The bridge port: hairpin and VLAN, then the alias and up in one request (the routed datapath's host end:
    :func:`cni.dataplane.routed.bring_up`)."""
    index = index_of(host_name)
    if conf.hairpin_mode:
        try:
            set_link(nl, index, [linkinfo(slave_kind="bridge", slave_data=[("IFLA_BRPORT_MODE", 1)])])
        except NetlinkError as e:
            raise nl_error(f"turn on hairpin mode on bridge port {host_name}", e) from None
    if conf.vlan:
        try:
            add_port_vlan(nl, index, conf.vlan)
            if conf.vlan != 1:  # the default VLAN every new port starts in
                del_port_vlan(nl, index, 1)
        except NetlinkError as e:
            raise nl_error(f"vlan: put bridge port {host_name} into VLAN {conf.vlan}", e) from None
    try:
        set_link(nl, index, [("IFLA_IFALIAS", alias)], flags=IFF_UP, change=IFF_UP)
    except NetlinkError as e:
        raise nl_error(f"bring {host_name} up", e) from None


def delete_host_end(nl: Rtnl, host_name: str) -> bool:
    """Delete the pair through its host end; False when it was already gone."""
    try:
        delete_link(nl, host_name)
    except NetlinkError as e:
        if e.code == errno.ENODEV:
            return False
        raise nl_error(f"delete host interface {host_name}", e) from None
    return True
