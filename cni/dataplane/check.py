"""CHECK: the attachment still looks the way ADD left it (``prevResult``).

On the host: the host veth exists (code 3 when it does not: the attachment is not here) and is a port of the bridge,
or, routed, the node routes each of its addresses through it; with ``ipMasq``, a masquerade rule of the attachment
matches each of its addresses. In the pod netns: ``ifname`` exists with the MAC of prevResult's interface for it (and
the configured MTU), every address prevResult gives that interface is on it, every route of prevResult is in the
routing table, and, routed, each gateway is a permanent neighbour at the host veth's MAC. The first difference found
is the error, naming it.

An attachment is checked by the datapath it was made with, which the kernel shows (a host veth on a bridge is the
bridge datapath's; one without a master that carries the pod's host routes is the routed one's): a node moving from
one datapath to the other keeps its pods until they are recreated, and CHECK judges each as ADD made it.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from cni.dataplane import masq, names, routed
from cni.dataplane.netns import open_netns
from cni.dataplane.nl import AF_INET, AF_INET6, RT_TABLE_MAIN, Rtnl, addresses, get_link, host_socket, routes, socket_in
from cni.errors import DATAPLANE, INVALID_NETWORK_CONFIG, UNKNOWN_CONTAINER, CniError
from cni.netconf import BridgeConf
from cni.types import Result, Route


def check(conf: BridgeConf, container_id: str, netns: str, ifname: str, prev: Result) -> None:
    """Raise CniError naming the first mismatch between the kernel and ``prev``."""
    pod_index = None  # prevResult is read before the kernel is asked anything about it
    for i, iface in enumerate(prev.interfaces):
        if iface.name == ifname and iface.sandbox:
            pod_index = i
    if pod_index is None:
        raise CniError(INVALID_NETWORK_CONFIG, details=f"prevResult.interfaces: no interface {ifname} with a sandbox")
    pod_ips = [ip for ip in prev.ips if ip.interface is None or ip.interface == pod_index]
    host_name = names.host_veth_name(container_id, ifname)
    with host_socket() as nl:
        hv = get_link(nl, host_name)
        if hv is None:
            raise CniError(
                UNKNOWN_CONTAINER,
                details=f"container {container_id} ifname {ifname} is not attached (no host interface {host_name})",
            )
        host_mac = str(hv.get("IFLA_ADDRESS") or "")
        made_routed = False
        if not hv.get("IFLA_MASTER"):
            unrouted = routed.check_host(nl, host_name, int(hv["index"]), pod_ips)
            made_routed = conf.routed or not unrouted
            if conf.routed and unrouted:
                raise _mismatch(unrouted)
        if not made_routed:
            br = get_link(nl, conf.bridge)
            if br is None:
                raise _mismatch(f"bridge {conf.bridge} is missing")
            if hv.get("IFLA_MASTER") != br["index"]:
                raise _mismatch(f"host interface {host_name} is not a port of bridge {conf.bridge}")
    want = prev.interfaces[pod_index]
    if want.sandbox != netns:
        raise _mismatch(f"interface {ifname}: prevResult puts it in {want.sandbox}, not in {netns}")
    nsfd = open_netns(netns)
    try:
        with socket_in(nsfd, netns) as nsr:
            link = get_link(nsr, ifname)
            if link is None:
                raise _mismatch(f"interface {ifname} is missing from {netns}")
            mac = str(link.get("IFLA_ADDRESS") or "")
            if want.mac and mac.lower() != want.mac.lower():
                raise _mismatch(f"interface {ifname}: MAC is {mac}, prevResult says {want.mac}")
            mtu = link.get("IFLA_MTU")
            if conf.mtu and mtu != conf.mtu:
                raise _mismatch(f"interface {ifname}: MTU is {mtu}, the network config says {conf.mtu}")
            have = set(addresses(nsr, int(link["index"])))
            for ip in pod_ips:
                if ip.address not in have:
                    raise _mismatch(f"interface {ifname}: address {ip.address} is missing")
            if made_routed:
                families = {ip.version for ip in pod_ips}
                wrong = routed.check_pod(nsr, ifname, int(link["index"]), families, host_mac)
                if wrong:
                    raise _mismatch(wrong)
            if prev.routes:
                table = _routes(nsr)
                for route in prev.routes:
                    if not _has_route(table, route):
                        via = f" via {route.gw}" if route.gw is not None else ""
                        raise _mismatch(f"route {route.dst}{via} is missing from {netns}")
    finally:
        os.close(nsfd)
    if conf.ip_masq:
        sources = masq.sources(conf.name, host_name)
        for ip in pod_ips:
            if str(ip.address.ip) not in sources:
                raise _mismatch(f"ipMasq: no masquerade rule for {ip.address.ip} (host interface {host_name})")


def _mismatch(what: str) -> CniError:
    return CniError(DATAPLANE, "CHECK failed", what)


RouteKey = tuple[int, Any, Any]  # (table, dst network, gateway address or None)


def _routes(nsr: Rtnl) -> set[RouteKey]:
    out: set[RouteKey] = set()
    for family, zero in ((AF_INET, "0.0.0.0"), (AF_INET6, "::")):
        for msg in routes(nsr, family):
            dst = msg.get("RTA_DST") or zero
            gw = msg.get("RTA_GATEWAY")
            table = msg.get("RTA_TABLE") or msg["table"]
            out.add(
                (
                    int(table),
                    ipaddress.ip_network(f"{dst}/{msg['dst_len']}", strict=False),
                    ipaddress.ip_address(gw) if gw else None,
                )
            )
    return out


def _has_route(table: set[RouteKey], route: Route) -> bool:
    return (route.table or RT_TABLE_MAIN, route.dst, route.gw) in table
