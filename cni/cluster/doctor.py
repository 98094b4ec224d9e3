"""``nodeplug doctor``: is every peer node's pod subnet routed the way the mode says?

An independent look, not the agent's own account: the Nodes are listed from the API server here, the plan is
computed from them (:mod:`cni.cluster.plan`) and compared with what this node's kernel holds
(:mod:`cni.cluster.kernel`).
A missing or wrong route, FDB or neighbour entry, or a peer the mode cannot route, fails the check naming the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
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


def _redirect_seen(node: NodeInfo | None, underlay: str) -> tuple[list[str], int, int]:
    """In this netns: the routed pods' veths and ways in without exactly one nodeplug redirect program; how many of
    each there are."""
    from cni.dataplane.rtnl import Rtnl
    from cni.redirect import bpf, manager

    nl = Rtnl()
    try:
        veths = manager.pod_veths(nl)
        ways: dict[int, str] = {}
        vx = kernel.vxlan_index(nl)
        if vx is not None:
            ways[vx] = kernel.VXLAN_DEVICE
        if node is not None and node.internal_ips:
            with contextlib.suppress(kernel.KernelError):
                under = kernel.underlay_of(nl, node.internal_ips[0], underlay)
                ways[under.ifindex] = under.name
    finally:
        nl.close()
    problems: list[str] = []
    for index, name in sorted({**veths, **ways}.items(), key=lambda kv: kv[1]):
        try:
            ours = len(manager.ours_on(index))
        except bpf.BpfError as e:
            problems.append(f"{name}: {e}")
            continue
        if ours != 1:
            problems.append(f"{name}: {ours or 'no'} redirect program{'s' if ours > 1 else ''}")
    return problems, len(veths), len(ways)


async def redirect_attached(cfg: ClusterConfig, kube: KubeClient | None, node: str) -> str:
    """With ``redirect`` on, the program on every routed pod's veth and on each way in (the underlay of this node's
    InternalIP, the VXLAN device), once each, as the kernel lists them."""
    if not cfg.redirect:
        raise CheckSkipped("cluster_network.redirect is false")
    from cni.redirect import program
    from cni.redirect.btf import BtfError

    try:
        await asyncio.to_thread(program.Kernel.read)
    except BtfError as e:
        raise CheckWarning(f"this kernel cannot run it ({e}): pods are forwarded the ordinary way") from None
    own = None
    if kube is not None:
        with contextlib.suppress(KubeError):
            own = next((n for n in await list_nodes(kube) if n.name == node), None)
    problems, pods, ways = await asyncio.to_thread(_redirect_seen, own, cfg.vxlan.underlay)
    summary = f"{pods} routed pod veth(s), {ways} way(s) in"
    if problems:
        raise CheckFailed(f"{summary}; " + "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                                                       if len(problems) > 8 else ""))  # fmt: skip
    return f"{summary}, each with the redirect program"


def checks(section: ClusterConfig, ctx: AgentContext) -> list[Check]:
    async def routed() -> str:
        return await peers_routed(section, ctx.kube, ctx.node_name)

    async def space() -> str:
        return await pod_space(section, ctx.kube)

    async def redirect() -> str:
        return await redirect_attached(section, ctx.kube, ctx.node_name)

    return [
        Check("cluster_network", "podCIDRs inside the cluster CIDRs", space),
        Check("cluster_network", "peer pod subnets routed as the mode says", routed),
        Check("cluster_network", "redirect on every routed pod and way in", redirect),
    ]
