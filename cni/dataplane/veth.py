"""The veth pair: host end on the bridge (or, routed, on its own), the other end created directly inside the pod's
netns as ``ifname``.

Creating the peer in the target netns under its final name (VETH_INFO_PEER with IFLA_NET_NS_FD) is one atomic netlink
request: when ``ifname`` is already taken in the pod, the kernel refuses it and nothing is left on either side, and
there is no temporary name to rename. The host end gets its deterministic name (:func:`names.host_veth_name`), the
bridge as master, the MTU, and an alias marking it as ours; hairpin, the VLAN and no IPv6 address go on the bridge
port.

Deleting the host end deletes the pair, so DEL never needs the pod's netns.
"""

from __future__ import annotations

import errno
import os
import socket

from cni.dataplane.messages import Message
from cni.dataplane.nl import (
    BRIDGE_VLAN_INFO_PVID,
    BRIDGE_VLAN_INFO_UNTAGGED,
    IFF_UP,
    IN6_ADDR_GEN_MODE_NONE,
    Attr,
    NetlinkError,
    Rtnl,
    create_link,
    delete_link,
    get_link,
    link_msg,
    linkinfo,
    nl_error,
    port_vlan_msg,
    random_mac,
)
from cni.dataplane.rtnl import RTM_DELLINK, RTM_NEWLINK, RTM_SETLINK
from cni.errors import DATAPLANE, CniError
from cni.netconf import BridgeConf
from cni.types import Interface

IPV6_MIN_MTU = 1280


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
    """The bridge port, in one batch: hairpin, no IPv6 address of its own, the VLAN, then the alias and up (the
    routed datapath's host end: :func:`cni.dataplane.routed.bring_up`).

    A bridge port carries frames, it has no use for an address: without one (address generation mode "none",
    before it comes up) the kernel neither gives it an IPv6 link-local address nor runs duplicate address detection
    for it, timer work that takes the RTNL lock every other ADD and DEL on the node waits for."""
    index = index_of(host_name)
    steps: list[tuple[str, tuple[Message, int, int]]] = []
    if conf.hairpin_mode:
        hairpin = [linkinfo(slave_kind="bridge", slave_data=[("IFLA_BRPORT_MODE", 1)])]
        steps.append((f"turn on hairpin mode on bridge port {host_name}", (link_msg(index, hairpin), RTM_NEWLINK, 0)))
    if _has_ipv6(conf):
        no_address = [("IFLA_AF_SPEC", [("AF_INET6", [("IFLA_INET6_ADDR_GEN_MODE", IN6_ADDR_GEN_MODE_NONE)])])]
        what = f"no IPv6 link-local address on bridge port {host_name}"
        steps.append((what, (link_msg(index, no_address), RTM_NEWLINK, 0)))
    if conf.vlan:
        what = f"vlan: put bridge port {host_name} into VLAN {conf.vlan}"
        steps.append((what, (port_vlan_msg(index, conf.vlan, BRIDGE_VLAN_INFO_PVID | BRIDGE_VLAN_INFO_UNTAGGED),
                             RTM_SETLINK, 0)))  # fmt: skip
        if conf.vlan != 1:  # the default VLAN every new port starts in
            steps.append((what, (port_vlan_msg(index, 1, 0), RTM_DELLINK, 0)))
    up = link_msg(index, [("IFLA_IFALIAS", alias)], flags=IFF_UP, change=IFF_UP)
    steps.append((f"bring {host_name} up", (up, RTM_NEWLINK, 0)))
    try:
        nl.ack_batch([request for _, request in steps])
    except NetlinkError as e:
        raise nl_error(steps[e.index][0], e) from None


def _has_ipv6(conf: BridgeConf) -> bool:
    """Whether the host end has IPv6 to configure: not on a kernel booted without it, nor below IPv6's minimum MTU
    (1280), where the kernel gives a link none."""
    return (not conf.mtu or conf.mtu >= IPV6_MIN_MTU) and os.path.isdir("/proc/sys/net/ipv6")


def delete_host_end(nl: Rtnl, host_name: str) -> bool:
    """Delete the pair through its host end; False when it was already gone."""
    try:
        delete_link(nl, host_name)
    except NetlinkError as e:
        if e.code == errno.ENODEV:
            return False
        raise nl_error(f"delete host interface {host_name}", e) from None
    return True
