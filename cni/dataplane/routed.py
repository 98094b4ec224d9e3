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
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Sequence
from typing import Any

from cni import datapath
from cni.dataplane import sysctl
from cni.dataplane.nl import (
    AF_INET,
    AF_INET6,
    NUD_PERMANENT,
    RT_TABLE_MAIN,
    NetlinkError,
    Rtnl,
    add_route,
    neighbours,
    nl_error,
    routes,
)
from cni.errors import DATAPLANE, CniError
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


def add_host_routes(nl: Rtnl, host_name: str, index: int, ips: Sequence[IPConfig]) -> None:
    """A host route to each pod address through the host-side veth (they vanish with it)."""
    for ip in host_ips(ips):
        try:
            add_route(nl, Route(ip.address.network), index)
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                raise CniError(
                    DATAPLANE,
                    details=f"route {ip.address.network}: the node already routes this pod address elsewhere "
                    f"(`ip route show {ip.address.ip}`)",
                ) from None
            raise nl_error(f"add route {ip.address.network} dev {host_name}", e) from None


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
