"""Pods on several real nodes (``NODEPLUG_TEST_NODES=3``: ``scripts/cluster-up DIR --nodes 3``), as a user meets
them, in both route modes of the cluster pod network (the shipped ``auto``, which is direct routes between nodes on
one segment, and ``vxlan``, set in the agent's config and rolled out as an operator does): each node holds a route to
every other node's podCIDRs (IPv4 and IPv6: the tier runs dual stack) the way the mode says; every pair of nodes
talks pod to pod over TCP and UDP in each family with the client's address kept; a pod reaches a Service whose
endpoint is on another node (kube-proxy).

The servers are agnhost ``netexec`` (the upstream suites' workload image): ``/clientip`` over HTTP and ``clientip``
over UDP answer with the address the packet came from. Skipped on a one-node cluster.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from support import kubeassets

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

AGNHOST = "localhost/e2e/agnhost:2.53"  # scripts/cluster/e2eimages.py, imported by cluster-up
VXLAN_DEVICE = "nodeplug.vx"


@pytest.fixture
def nodes(cluster: Cluster) -> list[str]:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=1; by default the tier runs on three)")
    if reason := kubeassets.absent("agnhost"):
        pytest.skip(reason)
    return cluster.nodes


@pytest.fixture(scope="module", params=["auto", "vxlan"])
def route_mode(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[str]:
    """The cluster network's mode on every node: the shipped one, then ``vxlan`` (put back afterwards)."""
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster has no peer to route to")
    if request.param == "auto":
        yield "direct"  # every node on one segment
        return

    def vxlan(cfg: dict[str, Any]) -> None:
        cfg["cluster_network"]["mode"] = "vxlan"

    with cluster.agent_config(vxlan):
        yield "vxlan"


def netexec(name: str, node: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name, **labels}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "netexec", "image": AGNHOST, "imagePullPolicy": "Never",
                            "args": ["netexec", "--http-port=8080", "--udp-port=8081"]}],
        },
    }  # fmt: skip


def family(address: str) -> int:
    return ipaddress.ip_network(address, strict=False).version


def internal_ip(cluster: Cluster, node: str, version: int) -> str:
    addresses = cluster.get("node", node)["status"]["addresses"]
    return str(next(a["address"] for a in addresses if a["type"] == "InternalIP" and family(a["address"]) == version))


def routes_as_the_mode_says(cluster: Cluster, node: str, mode: str) -> list[str]:
    """What is wrong with ``node``'s routes to its peers' podCIDRs in ``mode`` (nothing: an empty list)."""
    routes = cluster.cluster_routes(node)
    wrong = []
    for peer in cluster.nodes:
        if peer == node:
            continue
        cidrs = cluster.get("node", peer)["spec"]["podCIDRs"]
        if sorted(family(c) for c in cidrs) != [4, 6]:
            wrong.append(f"{peer}'s podCIDRs {cidrs} are not one of each family")
        for cidr in cidrs:
            r = routes.get(cidr)
            if r is None:
                wrong.append(f"no route to {peer}'s {cidr}")
            elif mode == "vxlan" and r.get("dev") != VXLAN_DEVICE:
                wrong.append(f"{cidr} via {r.get('dev')}, not {VXLAN_DEVICE}")
            elif mode == "direct" and (r.get("gateway"), r.get("dev")) != (gateway := internal_ip(
                cluster, peer, family(cidr)), "eth0"):  # fmt: skip
                wrong.append(f"{cidr} via {r.get('gateway')} dev {r.get('dev')}, not {gateway} on eth0")
    return wrong


def test_every_node_routes_to_every_peers_pods_as_the_mode_says(
    cluster: Cluster, nodes: list[str], route_mode: str
) -> None:
    for node in nodes:
        cluster.wait(f"{node}'s routes to its peers in {route_mode} mode",
                     lambda: not routes_as_the_mode_says(cluster, node, route_mode), 60,  # noqa: B023
                     explain=str(routes_as_the_mode_says(cluster, node, route_mode)))  # fmt: skip


def test_pod_to_pod_across_every_pair_of_nodes_keeps_the_source(
    cluster: Cluster, ns: str, nodes: list[str], route_mode: str
) -> None:
    pods = {node: f"p{k}" for k, node in enumerate(nodes)}
    cluster.apply(ns, *[netexec(pod, node) for node, pod in pods.items()])
    cluster.wait_running(ns, *pods.values())
    ips = {pod: {family(i["ip"]): i["ip"] for i in cluster.get("-n", ns, "pod", pod)["status"]["podIPs"]}
           for pod in pods.values()}  # fmt: skip
    assert all(sorted(by_family) == [4, 6] for by_family in ips.values()), f"not an address of each family: {ips}"
    for (a, b), version in itertools.product(itertools.permutations(pods.values(), 2), (4, 6)):
        src, dst = ips[a][version], ips[b][version]
        host = f"[{dst}]" if version == 6 else dst
        seen = cluster.exec(ns, a, "curl", "-sS", "--max-time", "5", f"http://{host}:8080/clientip")
        assert seen.rsplit(":", 1)[0].strip("[]") == src, f"TCP {a} -> {b} ({route_mode}): {b} saw {seen!r}, not {src}"
        seen = cluster.exec(ns, a, "sh", "-c", f"echo clientip | nc -u -w 2 {dst} 8081")
        assert seen.strip().rsplit(":", 1)[0].strip("[]") == src, f"UDP {a} -> {b} ({route_mode}): {b} saw {seen!r}"


def test_a_service_whose_endpoint_is_on_another_node(
    cluster: Cluster, ns: str, nodes: list[str], route_mode: str
) -> None:
    server = netexec("server", nodes[-1])
    client = netexec("client", nodes[0])
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "server"},
               "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]}}  # fmt: skip
    cluster.apply(ns, server, client, service)
    cluster.wait_running(ns, "server", "client")
    ip = cluster.get("-n", ns, "service", "server")["spec"]["clusterIP"]

    def answer() -> str:  # once kube-proxy on the client's node has the endpoint
        return cluster.kubectl("-n", ns, "exec", "client", "--", "curl", "-sS", "--max-time", "3",
                               f"http://{ip}/hostname", check=False).strip()  # fmt: skip

    cluster.wait(f"the Service {ip} answering from {nodes[0]}", lambda: answer() == "server", 60,
                 explain=f"last answer: {answer()!r}")  # fmt: skip
