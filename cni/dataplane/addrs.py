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

from cni.dataplane.messages import Message
from cni.dataplane.nl import CREATE, IFF_UP, NetlinkError, Rtnl, addr_msg, link_msg, neigh_msg, nl_error, route_msg
from cni.dataplane.rtnl import RTM_NEWADDR, RTM_NEWLINK, RTM_NEWNEIGH, RTM_NEWROUTE
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
    the gateways' neighbour entries, then the routes; all in one batch (the kernel runs them in this order), the error
    naming the first step it refused (the caller's undo deletes the pair, and everything here with it)."""
    steps: list[tuple[str, tuple[Message, int, int]]] = [
        (f"bring lo up in {netns}", (link_msg(LOOPBACK_INDEX, flags=IFF_UP, change=IFF_UP), RTM_NEWLINK, 0)),
        (f"bring {ifname} up in {netns}", (link_msg(index, flags=IFF_UP, change=IFF_UP), RTM_NEWLINK, 0)),
    ]
    steps += [
        (f"add address {ip.address} to {ifname} in {netns}", (addr_msg(index, ip.address), RTM_NEWADDR, CREATE))
        for ip in ips
    ]
    steps += [
        (f"add neighbour {gw} lladdr {mac} to {ifname} in {netns}", (neigh_msg(index, gw, mac), RTM_NEWNEIGH, CREATE))
        for gw, mac in gateways
    ]
    onlink = {gw for gw, _ in gateways}
    for route in routes:
        via = f" via {route.gw}" if route.gw is not None else ""
        request = (route_msg(route, index, onlink=route.gw in onlink), RTM_NEWROUTE, CREATE)
        steps.append((f"add route {route.dst}{via} dev {ifname} in {netns}", request))
    try:
        nsr.ack_batch([request for _, request in steps])
    except NetlinkError as e:
        what, (_, msg_type, _) = steps[e.index]
        if msg_type == RTM_NEWROUTE and e.code == errno.EEXIST:
            route = routes[e.index - (len(steps) - len(routes))]
            via = f" via {route.gw}" if route.gw is not None else ""
            raise CniError(
                DATAPLANE, details=f"route {route.dst}{via} in {netns}: a route to {route.dst} already exists"
            ) from None
        raise nl_error(what, e) from None
