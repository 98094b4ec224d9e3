"""The routed datapath's kernel work: no bridge, a host route per pod address, the link-local gateway in the pod.

What ADD builds (:func:`cni.dataplane.attach.add` runs the steps it shares with the bridge datapath)::

    node                                          pod
    veth<hash> (no master, no address)  <----->   eth0  10.244.1.5/32, fd44:0:0:1::5/128
      10.244.1.5 dev veth<hash> scope link          169.254.1.1 lladdr <veth<hash>'s MAC> PERMANENT
      fd44:0:0:1::5 dev veth<hash>                  fe80::1     lladdr <veth<hash>'s MAC> PERMANENT
                                                    default via 169.254.1.1 dev eth0 onlink
                                                    default via fe80::1 dev eth0 onlink

Why the gateway is link-local and resolved by a neighbour entry: :mod:`cni.datapath`. The host-side veth keeps the
name and alias of the bridge datapath (:mod:`cni.dataplane.names`), so DEL, GC, the masquerade rules and anything
keyed on them work alike on both. Pods on one node reach each other through the node's routing table (one host
route each); pod traffic crosses the node's ``inet`` forward hook either way, so filtering keyed on pod addresses
sees it. The host routes go with the veth: DEL deletes nothing else. Its IPv6 link-local address is usable at once
(``accept_dad`` 0 on it before it comes up), so the node answers the pod's first packet without waiting for DAD.

A node moving over from the bridge datapath keeps its bridged pods until they are recreated, and they see their
whole subnet on their link: to reach a routed pod of the same subnet they ask for its address on the bridge (ARP,
neighbour solicitation), where nobody has it. So while the network's bridge exists (one nodeplug made: it carries
:data:`cni.dataplane.names.BRIDGE_ALIAS`) the bridge answers for the routed pods: proxy ARP on it (the kernel
answers for an address it routes through another interface, and only for such: bridged pods still answer for
themselves) and, IPv6 having no such rule, a proxy neighbour entry on it per routed pod address, removed by DEL
(and by GC once no host route is left for it). The bridged pod then sends to the node, which routes to the pod.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Sequence
from typing import Any

from cni import datapath
from cni.dataplane import sysctl
from cni.dataplane.messages import Message
from cni.dataplane.names import BRIDGE_ALIAS
from cni.dataplane.nl import (
    AF_INET,
    AF_INET6,
    CREATE,
    IFF_UP,
    NUD_PERMANENT,
    RT_TABLE_MAIN,
    NetlinkError,
    Rtnl,
    add_proxy,
    del_proxy,
    get_link,
    link_kind,
    link_msg,
    neighbours,
    nl_error,
    proxies,
    route_msg,
    routes,
)
from cni.dataplane.rtnl import RTM_NEWLINK, RTM_NEWROUTE
from cni.errors import DATAPLANE, CniError, quietly
from cni.types import IPConfig, Route


def gateways(families: set[int], host_mac: str) -> list[tuple[Any, str]]:
    """The pod's neighbour entries: each family's link-local gateway at the host-side veth's MAC."""
    return [(datapath.GATEWAY[v], host_mac) for v in sorted(families)]


def host_ips(ips: Sequence[IPConfig]) -> list[IPConfig]:
    return [datapath.host_address(ip) for ip in ips]


def before_up(host_name: str, families: set[int]) -> None:
    """On the node, before the host-side veth comes up: its IPv6 link-local address without DAD."""
    if 6 in families:
        sysctl.ensure(sysctl.conf_key(6, host_name, "accept_dad"), "0", missing_ok=True)


def bring_up(nl: Rtnl, host_name: str, index: int, alias: str, ips: Sequence[IPConfig]) -> None:
    """The host-side veth's alias and up, then a host route to each pod address through it (they vanish with it):
    one batch."""
    requests: list[tuple[Message, int, int]] = [
        (link_msg(index, [("IFLA_IFALIAS", alias)], flags=IFF_UP, change=IFF_UP), RTM_NEWLINK, 0)
    ]
    requests += [(route_msg(Route(ip.address.network), index), RTM_NEWROUTE, CREATE) for ip in host_ips(ips)]
    try:
        nl.ack_batch(requests)
    except NetlinkError as e:
        if not e.index:
            raise nl_error(f"bring {host_name} up", e) from None
        network = host_ips(ips)[e.index - 1].address.network
        if e.code == errno.EEXIST:
            raise CniError(
                DATAPLANE,
                details=f"route {network}: the node already routes this pod address elsewhere "
                f"(`ip route show {network.network_address}`)",
            ) from None
        raise nl_error(f"add route {network} dev {host_name}", e) from None


def check_host(nl: Rtnl, host_name: str, index: int, ips: Sequence[IPConfig]) -> str:
    """CHECK on the node: a host route to each address of ``ips`` through link ``index``; the first difference."""
    have: set[Any] = set()
    for family in (AF_INET, AF_INET6):
        for msg in routes(nl, family):
            if msg.get("RTA_OIF") == index and int(msg.get("RTA_TABLE") or msg["table"]) == RT_TABLE_MAIN:
                have.add(ipaddress.ip_network(f"{msg.get('RTA_DST')}/{msg['dst_len']}", strict=False))
    for ip in host_ips(ips):
        if ip.address.network not in have:
            return f"the node has no route to {ip.address.ip} through {host_name}"
    return ""


def check_pod(nsr: Rtnl, ifname: str, index: int, families: set[int], host_mac: str) -> str:
    """CHECK in the pod: each family's gateway is a permanent neighbour at the host-side veth's MAC."""
    have = neighbours(nsr, index)
    for gw, mac in gateways(families, host_mac):
        got, state = have.get(str(gw), ("", 0))
        if got.lower() != mac.lower() or not state & NUD_PERMANENT:
            return f"interface {ifname}: gateway {gw} is not a permanent neighbour at {mac} (the node's side)"
    return ""


def _bridge_of(nl: Rtnl, name: str) -> int | None:
    """The index of the network's bridge when nodeplug made it (it holds bridged pods), else None."""
    msg = get_link(nl, name)
    if msg is None or link_kind(msg) != "bridge" or msg.get("IFLA_IFALIAS") != BRIDGE_ALIAS:
        return None
    return int(msg["index"])


def answer_on_bridge(nl: Rtnl, bridge: str, ips: Sequence[IPConfig]) -> list[Any]:
    """The bridged pods of a node moving over reach this routed pod: proxy ARP and proxy NDP on the network's
    bridge, if there is one. The IPv6 addresses given a proxy entry (for the caller to undo)."""
    index = _bridge_of(nl, bridge)
    if index is None:
        return []
    if any(ip.version == 4 for ip in ips):
        sysctl.ensure(sysctl.conf_key(4, bridge, "proxy_arp"), "1")
    v6 = [ip.address.ip for ip in ips if ip.version == 6]
    if v6:
        sysctl.ensure(sysctl.conf_key(6, bridge, "proxy_ndp"), "1")
    added: list[Any] = []
    for a in v6:
        try:
            add_proxy(nl, index, a)
        except NetlinkError as e:
            quietly(_forget, nl, bridge, index, added)  # the caller's undo only knows of a complete answer
            raise nl_error(f"answer for {a} on bridge {bridge} (proxy NDP)", e) from None
        added.append(a)
    return added


def forget_on_bridge(nl: Rtnl, bridge: str, addresses: Sequence[Any]) -> None:
    """DEL and undo: the bridge no longer answers for ``addresses`` (IPv6; IPv4's proxy ARP follows the routes)."""
    v6 = [a for a in addresses if a.version == 6]
    index = _bridge_of(nl, bridge) if v6 else None
    if index is not None:
        _forget(nl, bridge, index, v6)


def forget_stale_on_bridge(nl: Rtnl, bridge: str) -> None:
    """GC: the bridge's proxy entries for addresses the node no longer routes to a host veth go."""
    index = _bridge_of(nl, bridge)
    if index is None:
        return
    routed = {
        ipaddress.ip_address(str(msg.get("RTA_DST")))
        for msg in routes(nl, AF_INET6)
        if msg["dst_len"] == 128 and msg.get("RTA_DST") and msg.get("RTA_OIF") != index
    }
    _forget(nl, bridge, index, [a for a in proxies(nl, index) if a not in routed])


def _forget(nl: Rtnl, bridge: str, index: int, v6: Sequence[Any]) -> None:
    for a in v6:
        try:
            del_proxy(nl, index, a)
        except NetlinkError as e:
            raise nl_error(f"stop answering for {a} on bridge {bridge}", e) from None
