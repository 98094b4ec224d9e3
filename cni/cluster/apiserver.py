"""The node's lifeline, the API server, as the cluster network sees it: where it is (:func:`addresses`), never
routed to a pod network, and which routes of ours its path runs through while it does not answer
(:func:`withdraw`), taken away so that the node keeps its way to it whatever the Nodes say."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from urllib.parse import urlsplit

from lightkube.resources.core_v1 import Endpoints

from cni.cluster import kernel
from cni.cluster.model import IPAddress, IPNetwork
from cni.cluster.plan import RouteSpec
from cni.dataplane.rtnl import Rtnl
from nodeplug.kube import KubeClient, KubeError
from nodeplug.log import Logger


async def addresses(kube: KubeClient, known: tuple[IPAddress, ...]) -> tuple[IPAddress, ...]:
    """The server's host (resolved when it is a name) and the endpoints of the ``kubernetes`` Service (in a pod the
    server is its ClusterIP, and packets go where kube-proxy sends them); ``known`` kept while the endpoints cannot
    be read (RBAC, or the API away)."""
    found: list[IPAddress] = []
    host = urlsplit(kube.source.server).hostname or ""
    try:
        found.append(ipaddress.ip_address(host))
    except ValueError:
        with contextlib.suppress(OSError):
            for *_, addr in await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM):
                found.append(ipaddress.ip_address(str(addr[0]).split("%")[0]))
    try:
        endpoints: Endpoints | None = await kube.get(Endpoints, "kubernetes", namespace="default")
    except KubeError:
        endpoints = None
    for subset in (endpoints.subsets if endpoints is not None else None) or ():
        for a in subset.addresses or ():
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_address(a.ip))
    return tuple(dict.fromkeys([*found, *(known if endpoints is None else ())]))


def withdraw(
    nl: Rtnl, servers: tuple[IPAddress, ...], have: dict[IPNetwork, RouteSpec], protocol: int, log: Logger
) -> list[tuple[IPNetwork, str]]:
    """On the netlink thread: delete each route of ours (``protocol``) that the path to a server address takes, and
    forget it in ``have``; the routes withdrawn, each with why."""
    out = []
    for address in servers:
        path = kernel.path_to(nl, address)
        if path is None or path.protocol != protocol or path.dst.prefixlen == 0:
            continue
        route = have.get(path.dst) or RouteSpec(path.dst, address, vxlan=False)
        try:
            kernel.del_route(nl, route, protocol, None)
        except kernel.KernelError as e:
            log.error("cluster network: cannot withdraw a route taking the API server's path", error=str(e))
            continue
        have.pop(path.dst, None)
        out.append((path.dst, f"the path to the API server at {address} ran through it, and it did not answer"))
    return out
