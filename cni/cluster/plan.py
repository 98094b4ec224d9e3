"""What this node's kernel should hold for the cluster network, and what to change to get there. Pure.

For each other node (a *peer*) and each address family of its podCIDRs, the mode picks a path:

- ``direct``: a route to the peer's podCIDR via the peer's InternalIP of that family. Needs that address on a
  subnet this node is directly connected to (the kernel refuses a gateway it cannot reach on a link);
- ``vxlan``: a route to the podCIDR via the peer's VTEP next hop, on-link on the VXLAN device; a permanent
  neighbour entry (next hop -> peer's VTEP MAC) and an FDB entry (peer's VTEP MAC -> peer's underlay address). The
  next hop is the podCIDR's network address: one per family per peer, never assigned to any interface, only a
  key for the neighbour entry (as in flannel). One VXLAN device over one underlay family carries both inner
  families, so a dual-stack pod network needs neither a dual-stack underlay nor a second device;
- ``auto``: direct where possible, else vxlan.

A peer that cannot be routed the way the mode says (no InternalIP on a connected subnet in direct mode; no VTEP
annotation yet, or a VTEP of the other underlay family, in vxlan mode) gets no route and an entry in
:attr:`Desired.unrouted` naming the reason. Conflicts from hostile or broken Node objects (a podCIDR overlapping
this node's or an earlier peer's, a VTEP MAC another peer already uses) are settled by name order and reported the
same way, so the outcome never depends on the order of events.

**The node's lifelines are never routed away.** A podCIDR (a peer's, and this node's own, which the pod bridge and
its pods would take) is refused when it :func:`trespasses`: it overlaps a subnet this node is connected to, holds an
address the node depends on (:attr:`Local.lifelines`: the API server's addresses, the default gateways, the node's
InternalIPs), touches address space that is never a pod network (loopback, link-local, multicast, broadcast and
reserved, unspecified, IPv4-mapped IPv6), lies outside the configured cluster CIDRs, or, when none are configured,
is broader than :attr:`Local.broadest` allows. A peer whose InternalIP or VTEP address is this node's own gets no
route or FDB entry either. This node's own podCIDRs that pass are :attr:`Desired.own`, the only ones the pod
network may use; the others are in :attr:`Desired.own_refused` with the reason.

:func:`changes` compares a :class:`State` the kernel has (only entries the agent owns: routes of its protocol,
FDB and neighbour entries on its VXLAN device) with the desired one and returns exactly what differs, so a
restarted agent leaves correct entries alone and traffic never pauses.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable
from typing import Literal, NamedTuple

from cni.cluster.model import IPAddress, IPNetwork, NodeInfo, Vtep

Mode = Literal["direct", "vxlan", "auto"]


class RouteSpec(NamedTuple):
    dst: IPNetwork
    gateway: IPAddress
    vxlan: bool  # on-link via the VXLAN device; else via the underlay (the kernel picks the interface)


# Address space that is never a pod network, whatever the Nodes say.
NEVER_POD_SPACE: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",  # "this network", the unspecified address
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast address 255.255.255.255
        "::/127",  # unspecified and loopback
        "::ffff:0:0/96",  # IPv4-mapped
        "fe80::/10",  # link-local
        "ff00::/8",  # multicast
    )
)
# With no cluster CIDRs configured, the broadest podCIDR accepted per family (a prefix length): a /1 would take half
# of every remote destination.
BROADEST = (16, 48)


class Local(NamedTuple):
    """This node as the plan sees it."""

    name: str
    pod_cidrs: tuple[IPNetwork, ...] = ()  # this node's podCIDRs as its Node says (judged like a peer's)
    connected: tuple[IPNetwork, ...] = ()  # underlay subnets this node is on (its own pod subnets excluded)
    vtep: Vtep | None = None  # this node's VXLAN endpoint, None when the mode uses none (direct)
    cluster: tuple[IPNetwork, ...] = ()  # cluster_network.cluster_cidrs: when set, every podCIDR lies in one
    lifelines: tuple[IPAddress, ...] = ()  # API server addresses, default gateways, this node's own addresses
    broadest: tuple[int, int] = BROADEST  # without cluster CIDRs: the shortest prefix accepted (IPv4, IPv6)


class State(NamedTuple):
    """Routes (by destination), FDB entries (MAC -> underlay address) and neighbours (next hop -> MAC)."""

    routes: dict[IPNetwork, RouteSpec]
    fdb: dict[str, IPAddress]
    neigh: dict[IPAddress, str]

    @staticmethod
    def empty() -> State:
        return State({}, {}, {})


class Desired(NamedTuple):
    state: State
    paths: dict[tuple[str, int], str]  # (peer, IP version) -> "direct" | "vxlan"
    unrouted: dict[tuple[str, int], str]  # (peer, IP version) -> why it has no route
    refused: frozenset[tuple[str, int]] = frozenset()  # (peer, IP version) whose podCIDR is no pod network: a conflict
    own: tuple[IPNetwork, ...] = ()  # this node's podCIDRs the pod network may use
    own_refused: tuple[tuple[IPNetwork, str], ...] = ()  # this node's other podCIDRs, with the reason


class Changes(NamedTuple):
    fdb_set: list[tuple[str, IPAddress]]
    neigh_set: list[tuple[IPAddress, str]]
    routes_set: list[RouteSpec]
    routes_del: list[RouteSpec]
    neigh_del: list[tuple[IPAddress, str]]
    fdb_del: list[tuple[str, IPAddress]]

    def __bool__(self) -> bool:
        return any(len(x) for x in self)

    def total(self) -> int:
        return sum(len(x) for x in self)


class _Claims:
    """Pod networks already given out, per family as sorted disjoint intervals: an overlap test costs a bisection,
    so a plan for thousands of nodes stays linear."""

    def __init__(self) -> None:
        self._starts: dict[int, list[int]] = {4: [], 6: []}
        self._spans: dict[int, list[tuple[int, int, str]]] = {4: [], 6: []}

    def owner_overlapping(self, net: IPNetwork) -> str | None:
        lo, hi = int(net.network_address), int(net.broadcast_address)
        starts, spans = self._starts[net.version], self._spans[net.version]
        at = bisect.bisect_right(starts, hi)  # spans[at-1] is the last one starting at or before hi
        if at and spans[at - 1][1] >= lo:
            return spans[at - 1][2]
        return None

    def add(self, net: IPNetwork, owner: str) -> None:
        lo, hi = int(net.network_address), int(net.broadcast_address)
        at = bisect.bisect_left(self._starts[net.version], lo)
        self._starts[net.version].insert(at, lo)
        self._spans[net.version].insert(at, (lo, hi, owner))


def _direct_gateway(local: Local, peer: NodeInfo, version: int) -> tuple[IPAddress | None, str]:
    gw = peer.internal_ip(version)
    if gw is None:
        return None, f"no IPv{version} InternalIP"
    if gw in local.lifelines:
        return None, f"its InternalIP {gw} is an address this node depends on (its own, a gateway or the API server)"
    if not any(gw in net for net in local.connected):
        return None, f"InternalIP {gw} is not on a subnet this node is connected to"
    return gw, ""


def _vxlan_peer(local: Local, peer: NodeInfo) -> tuple[Vtep | None, str]:
    if local.vtep is None:
        return None, "this node has no VXLAN device yet"
    if peer.vtep is None:
        return None, "its agent has not published a VTEP yet (nodeplug.io/vtep-mac, nodeplug.io/vtep-address)"
    if peer.vtep.address.version != local.vtep.address.version:
        return None, f"its VTEP {peer.vtep.address} is of the other underlay family than this node's"
    if peer.vtep.mac == local.vtep.mac:
        return None, f"its VTEP MAC {peer.vtep.mac} is this node's own"
    if peer.vtep.address == local.vtep.address or peer.vtep.address in local.lifelines:
        return None, f"its VTEP address {peer.vtep.address} is an address this node depends on"
    return peer.vtep, ""


def trespasses(local: Local, cidr: IPNetwork) -> str:
    """Why ``cidr`` must not be a pod network on this node, a peer's or its own (see the module docstring); empty
    when it may be one."""
    never = next((n for n in NEVER_POD_SPACE if n.version == cidr.version and n.overlaps(cidr)), None)
    if never is not None:
        return f"podCIDR {cidr} overlaps {never}, which is never a pod network"
    underlay = next((n for n in local.connected if n.version == cidr.version and n.overlaps(cidr)), None)
    if underlay is not None:
        return f"podCIDR {cidr} overlaps {underlay}, a subnet this node is connected to"
    lifeline = next((a for a in local.lifelines if a in cidr), None)
    if lifeline is not None:
        return f"podCIDR {cidr} holds {lifeline}, an address this node depends on (API server, gateway or its own)"
    if local.cluster:
        if not any(c.version == cidr.version and cidr.subnet_of(c) for c in local.cluster):  # type: ignore[arg-type]
            return f"podCIDR {cidr} is outside cluster_network.cluster_cidrs"
    elif cidr.prefixlen < local.broadest[0 if cidr.version == 4 else 1]:
        limit = local.broadest[0 if cidr.version == 4 else 1]
        return (
            f"podCIDR {cidr} is broader than /{limit}, the broadest accepted while cluster_network.cluster_cidrs is "
            "empty (set it to the cluster CIDRs)"
        )
    return ""


def desired(local: Local, nodes: Iterable[NodeInfo], mode: Mode) -> Desired:
    """The state the kernel should have for ``nodes`` (this node among them or not)."""
    state = State.empty()
    paths: dict[tuple[str, int], str] = {}
    unrouted: dict[tuple[str, int], str] = {}
    refused: set[tuple[str, int]] = set()
    claimed = _Claims()
    own: list[IPNetwork] = []
    own_refused: list[tuple[IPNetwork, str]] = []
    for c in local.pod_cidrs:
        why = trespasses(local, c)
        if why:
            own_refused.append((c, why))
        elif claimed.owner_overlapping(c) is None:
            claimed.add(c, local.name)
            own.append(c)
    mac_owner: dict[str, str] = {}
    for peer in sorted(nodes, key=lambda n: n.name):
        if peer.name == local.name:
            continue
        vtep, vxlan_why = (None, "mode is direct") if mode == "direct" else _vxlan_peer(local, peer)
        if vtep is not None and mac_owner.setdefault(vtep.mac, peer.name) != peer.name:
            vxlan_why = f"its VTEP MAC {vtep.mac} is already node {mac_owner[vtep.mac]}'s"
            vtep = None
        for cidr in peer.pod_cidrs:
            key = (peer.name, cidr.version)
            clash = claimed.owner_overlapping(cidr)
            why = f"podCIDR {cidr} overlaps node {clash}'s" if clash is not None else trespasses(local, cidr)
            if why:
                unrouted[key] = why
                refused.add(key)
                continue
            gw, direct_why = (None, "mode is vxlan") if mode == "vxlan" else _direct_gateway(local, peer, cidr.version)
            if gw is not None:
                state.routes[cidr] = RouteSpec(cidr, gw, vxlan=False)
                paths[key] = "direct"
            elif vtep is not None:
                hop = cidr.network_address
                state.routes[cidr] = RouteSpec(cidr, hop, vxlan=True)
                state.neigh[hop] = vtep.mac
                state.fdb[vtep.mac] = vtep.address
                paths[key] = "vxlan"
            else:
                unrouted[key] = direct_why if mode == "direct" else vxlan_why if mode == "vxlan" else (
                    f"{direct_why}, and {vxlan_why}"
                )  # fmt: skip
                continue
            claimed.add(cidr, peer.name)
    return Desired(state, paths, unrouted, frozenset(refused), tuple(own), tuple(own_refused))


def changes(want: State, have: State) -> Changes:
    """What to set and delete so that ``have`` becomes ``want``; entries already right are not touched."""
    return Changes(
        fdb_set=[(m, a) for m, a in want.fdb.items() if have.fdb.get(m) != a],
        neigh_set=[(ip, m) for ip, m in want.neigh.items() if have.neigh.get(ip) != m],
        routes_set=[r for d, r in want.routes.items() if have.routes.get(d) != r],
        routes_del=[r for d, r in have.routes.items() if d not in want.routes],
        neigh_del=[(ip, m) for ip, m in have.neigh.items() if ip not in want.neigh],
        fdb_del=[(m, a) for m, a in have.fdb.items() if m not in want.fdb],
    )
