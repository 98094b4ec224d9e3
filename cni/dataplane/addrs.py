"""The pod side: loopback and ``ifname`` up, the addresses on ``ifname``, then the routes.

Everything goes through a netlink socket bound to the pod's netns (opened by :func:`cni.dataplane.nl.socket_in`), so
the calling thread stays in the host netns while it works. IPv6 addresses carry IFA_F_NODAD and the interface's
``accept_dad`` is 0 (set by the caller from inside the netns before this runs, before the link comes up), so neither
the global nor the link-local address is ever tentative: the pod can talk the moment ADD returns.

Routes are added exactly as given: a route with ``gw`` goes via that gateway on ``ifname``; one without is a link
route (scope link). ``mtu``/``advmss`` become route metrics; ``priority``, ``table`` and ``scope`` are passed on.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

from cni.dataplane.nl import IFF_UP, RT_SCOPE_LINK, NetlinkError, addr_args, nl_error
from cni.errors import DATAPLANE, CniError
from cni.types import IPConfig, Route

LOOPBACK_INDEX = 1  # the kernel registers lo first in every netns, as index 1 (LOOPBACK_IFINDEX)


def configure_pod(
    nsr: Any, netns: str, ifname: str, index: int, ips: Sequence[IPConfig], routes: Sequence[Route]
) -> None:
    """Configure ``ifname`` (link ``index``) inside the pod netns: loopback and the interface up, then the addresses,
    then the routes."""
    try:
        nsr.link("set", index=LOOPBACK_INDEX, flags=IFF_UP, change=IFF_UP)
    except NetlinkError as e:
        raise nl_error(f"bring lo up in {netns}", e) from None
    try:
        nsr.link("set", index=index, flags=IFF_UP, change=IFF_UP)
    except NetlinkError as e:
        raise nl_error(f"bring {ifname} up in {netns}", e) from None
    for ip in ips:
        try:
            nsr.addr("add", index=index, **addr_args(ip.address))
        except NetlinkError as e:
            raise nl_error(f"add address {ip.address} to {ifname} in {netns}", e) from None
    for route in routes:
        try:
            nsr.route("add", **route_args(route, index))
        except NetlinkError as e:
            via = f" via {route.gw}" if route.gw is not None else ""
            if e.code == errno.EEXIST:
                raise CniError(
                    DATAPLANE, details=f"route {route.dst}{via} in {netns}: a route to {route.dst} already exists"
                ) from None
            raise nl_error(f"add route {route.dst}{via} dev {ifname} in {netns}", e) from None


def route_args(route: Route, index: int) -> dict[str, Any]:
    args: dict[str, Any] = {"dst": str(route.dst), "oif": index}
    if route.gw is not None:
        args["gateway"] = str(route.gw)
    if route.scope is not None:
        args["scope"] = route.scope
    elif route.gw is None:
        args["scope"] = RT_SCOPE_LINK
    if route.priority is not None:
        args["priority"] = route.priority
    if route.table is not None:
        args["table"] = route.table
    metrics: dict[str, int] = {}
    if route.mtu:
        metrics["mtu"] = route.mtu
    if route.advmss:
        metrics["advmss"] = route.advmss
    if metrics:
        args["metrics"] = metrics
    return args
