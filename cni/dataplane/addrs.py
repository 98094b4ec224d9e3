"""The pod side: loopback and ``ifname`` up, the addresses on ``ifname``, then the routes.

Everything goes through a netlink socket bound to the pod's netns (opened by :func:`cni.dataplane.nl.socket_in`), so
the calling thread stays in the host netns while it works. IPv6 addresses carry IFA_F_NODAD and the interface's
``accept_dad`` is 0 (set by the caller from inside the netns before this runs, before the link comes up), so neither
the global nor the link-local address is ever tentative: the pod can talk the moment ADD returns.

Routes are added exactly as given: a route with ``gw`` goes via that gateway on ``ifname``; one without is a link
route (scope link). ``mtu``/``advmss`` become route metrics; ``priority``, ``table`` and ``scope`` are passed on.

``gateways`` (the routed datapath, :mod:`cni.dataplane.routed`): permanent neighbour entries (address -> MAC) put
in before the routes; a route via one of them is on-link, as no address of the pod covers it.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

from cni.dataplane.nl import IFF_UP, NetlinkError, Rtnl, add_addr, add_neighbour, add_route, nl_error, set_link
from cni.errors import DATAPLANE, CniError
from cni.types import IPConfig, Route

LOOPBACK_INDEX = 1  # the kernel registers lo first in every netns, as index 1 (LOOPBACK_IFINDEX)


def configure_pod(
    nsr: Rtnl,
    netns: str,
    ifname: str,
    index: int,
    ips: Sequence[IPConfig],
    routes: Sequence[Route],
    gateways: Sequence[tuple[Any, str]] = (),
) -> None:
    """Configure ``ifname`` (link ``index``) inside the pod netns: loopback and the interface up, then the addresses,
    the gateways' neighbour entries, then the routes."""
    try:
        set_link(nsr, LOOPBACK_INDEX, flags=IFF_UP, change=IFF_UP)
    except NetlinkError as e:
        raise nl_error(f"bring lo up in {netns}", e) from None
    try:
        set_link(nsr, index, flags=IFF_UP, change=IFF_UP)
    except NetlinkError as e:
        raise nl_error(f"bring {ifname} up in {netns}", e) from None
    for ip in ips:
        try:
            add_addr(nsr, index, ip.address)
        except NetlinkError as e:
            raise nl_error(f"add address {ip.address} to {ifname} in {netns}", e) from None
    for gw, mac in gateways:
        try:
            add_neighbour(nsr, index, gw, mac)
        except NetlinkError as e:
            raise nl_error(f"add neighbour {gw} lladdr {mac} to {ifname} in {netns}", e) from None
    onlink = {gw for gw, _ in gateways}
    for route in routes:
        try:
            add_route(nsr, route, index, onlink=route.gw in onlink)
        except NetlinkError as e:
            via = f" via {route.gw}" if route.gw is not None else ""
            if e.code == errno.EEXIST:
                raise CniError(
                    DATAPLANE, details=f"route {route.dst}{via} in {netns}: a route to {route.dst} already exists"
                ) from None
            raise nl_error(f"add route {route.dst}{via} dev {ifname} in {netns}", e) from None
