"""``nodeplug doctor``: is every peer node's pod subnet routed the way the mode says?

An independent look, not the agent's own account: the Nodes are listed from the API server here, the plan is
computed from them (:mod:`cni.cluster.plan`) and compared with what this node's kernel holds
(:mod:`cni.cluster.kernel`).
A missing or wrong route, FDB or neighbour entry, or a peer the mode cannot route, fails the check naming the peer.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any
from urllib.parse import urlsplit

from cni.cluster import kernel
from cni.cluster.config import ClusterConfig
from cni.cluster.model import IPAddress, NodeInfo, Vtep, parse_node
from cni.cluster.plan import Local, desired
from cni.dataplane.nl import links
from nodeplug.checks import Check, CheckFailed, CheckSkipped, CheckWarning
from nodeplug.kube import KubeClient, KubeError
from nodeplug.plugin import AgentContext


async def list_nodes(kube: KubeClient) -> list[NodeInfo]:
    from lightkube.resources.core_v1 import Node

    return [n for obj in await kube.list(Node) if (n := parse_node(obj)) is not None]


def _compare(
    cfg: ClusterConfig, node: str, nodes: list[NodeInfo], api: tuple[IPAddress, ...] = ()
) -> tuple[list[str], dict[str, int]]:
    from cni.dataplane.rtnl import Rtnl

    own = next((n for n in nodes if n.name == node), None)
    if own is None:
        raise CheckFailed(f"node {node} is not in the API server (check --node-name)")
    nl = Rtnl()
    try:
        vx = kernel.vxlan_index(nl) if cfg.mode != "direct" else None
        vtep = None
        if vx is not None and own.internal_ips:
            mac = next(str(m.get("IFLA_ADDRESS")) for m in links(nl) if int(m["index"]) == vx)
            vtep = Vtep(mac, own.internal_ips[0])
        connected = kernel.connected(nl, own.pod_cidrs, [vx] if vx is not None else [])
        cluster = tuple(ipaddress.ip_network(c) for c in cfg.cluster_cidrs)
        lifelines = tuple(dict.fromkeys((*api, *kernel.default_gateways(nl), *own.internal_ips)))
        broadest = (cfg.broadest_pod_cidr.ipv4, cfg.broadest_pod_cidr.ipv6)
        local = Local(node, own.pod_cidrs, tuple(connected), vtep, cluster, lifelines, broadest)
        want = desired(local, nodes, cfg.mode)
        have = kernel.read_owned(nl, cfg.route_protocol, vx).state
    finally:
        nl.close()
    problems = [f"{peer} IPv{v}: not routed ({why})" for (peer, v), why in sorted(want.unrouted.items())]
    by_name = {n.name: n for n in nodes}
    owner = {c: peer for peer, v in want.paths if (c := by_name[peer].pod_cidr(v)) is not None}
    for dst, r in sorted(want.state.routes.items(), key=lambda kv: str(kv[0])):
        got = have.routes.get(dst)
        if got != r:
            what = "missing" if got is None else f"via {got.gateway}{' on the VXLAN device' if got.vxlan else ''}"
            path = f"{r.gateway}{' on the VXLAN device' if r.vxlan else ''}"
            problems.append(f"{owner.get(dst, '?')}: route to {dst} {what}, want via {path}")
    for mac, under in want.state.fdb.items():
        if have.fdb.get(mac) != under:
            problems.append(f"FDB entry {mac} -> {under} missing")
    for hop, mac in want.state.neigh.items():
        if have.neigh.get(hop) != mac:
            problems.append(f"neighbour {hop} -> {mac} missing")
    counts = {p: sum(1 for x in want.paths.values() if x == p) for p in ("direct", "vxlan")}
    return problems, counts


async def peers_routed(cfg: ClusterConfig, kube: KubeClient | None, node: str) -> str:
    if kube is None:
        raise CheckSkipped("no Kubernetes API configured (--kubeconfig, KUBECONFIG or in-cluster): single-node")
    if not cfg.enabled:
        raise CheckSkipped("cluster_network.enabled is false")
    try:
        nodes = await list_nodes(kube)
    except KubeError as e:
        raise CheckFailed(f"cannot list Nodes: {e}") from None
    problems, counts = await asyncio.to_thread(_compare, cfg, node, nodes, _api_addresses(kube))
    summary = f"mode {cfg.mode}: direct {counts['direct']}, vxlan {counts['vxlan']}"
    if problems:
        shown: Any = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckFailed(f"{summary}; {shown}")
    return f"{summary}, every peer pod subnet routed"


def _api_addresses(kube: KubeClient) -> tuple[IPAddress, ...]:
    host = urlsplit(kube.source.server).hostname or ""
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        return ()


async def pod_space(cfg: ClusterConfig, kube: KubeClient | None) -> str:
    """Every Node's podCIDRs inside ``cluster_cidrs``, which the install should set (a podCIDR outside them is never
    used as a pod network)."""
    if kube is None:
        raise CheckSkipped("no Kubernetes API configured (--kubeconfig, KUBECONFIG or in-cluster): single-node")
    try:
        nodes = await list_nodes(kube)
    except KubeError as e:
        raise CheckFailed(f"cannot list Nodes: {e}") from None
    if not cfg.cluster_cidrs:
        raise CheckWarning(
            "cluster_network.cluster_cidrs is empty: set it to the cluster's --cluster-cidr (until then any podCIDR "
            f"no broader than /{cfg.broadest_pod_cidr.ipv4} (IPv4), /{cfg.broadest_pod_cidr.ipv6} (IPv6) is used)"
        )
    cluster = [ipaddress.ip_network(c) for c in cfg.cluster_cidrs]
    outside = [
        f"{n.name} {c}" for n in nodes for c in n.pod_cidrs
        if not any(c.version == x.version and c.subnet_of(x) for x in cluster)  # type: ignore[arg-type]
    ]  # fmt: skip
    if outside:
        raise CheckFailed(
            f"podCIDRs outside cluster_network.cluster_cidrs ({', '.join(cfg.cluster_cidrs)}), never used: "
            + ", ".join(outside[:8])
            + (f" and {len(outside) - 8} more" if len(outside) > 8 else "")
        )
    return f"every Node's podCIDRs inside {', '.join(cfg.cluster_cidrs)}"


def checks(section: ClusterConfig, ctx: AgentContext) -> list[Check]:
    async def routed() -> str:
        return await peers_routed(section, ctx.kube, ctx.node_name)

    async def space() -> str:
        return await pod_space(section, ctx.kube)

    return [
        Check("cluster_network", "podCIDRs inside the cluster CIDRs", space),
        Check("cluster_network", "peer pod subnets routed as the mode says", routed),
    ]
