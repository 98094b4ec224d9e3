"""Pods on several real nodes (``NODEPLUG_TEST_NODES=3``: ``scripts/cluster-up DIR --nodes 3``), as a user meets
them: every pair of nodes talks pod to pod over TCP and UDP with the client's address kept (the cluster pod network's
routes between the nodes' podCIDRs), and a pod reaches a Service whose endpoint is on another node (kube-proxy).

The servers are agnhost ``netexec`` (the upstream suites' workload image): ``/clientip`` over HTTP and ``clientip``
over UDP answer with the address the packet came from. Skipped on a one-node cluster.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import pytest

from support import kubeassets

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

AGNHOST = "localhost/e2e/agnhost:2.53"  # scripts/cluster/e2eimages.py, imported by cluster-up


@pytest.fixture
def nodes(cluster: Cluster) -> list[str]:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=3 runs the tier on three)")
    if reason := kubeassets.absent("agnhost"):
        pytest.skip(reason)
    return cluster.nodes


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


def test_pod_to_pod_across_every_pair_of_nodes_keeps_the_source(cluster: Cluster, ns: str, nodes: list[str]) -> None:
    pods = {node: f"p{k}" for k, node in enumerate(nodes)}
    cluster.apply(ns, *[netexec(pod, node) for node, pod in pods.items()])
    cluster.wait_running(ns, *pods.values())
    ips = {pod: cluster.get("-n", ns, "pod", pod)["status"]["podIP"] for pod in pods.values()}
    for a, b in itertools.permutations(pods.values(), 2):
        seen = cluster.exec(ns, a, "curl", "-sS", "--max-time", "5", f"http://{ips[b]}:8080/clientip")
        assert seen.rsplit(":", 1)[0] == ips[a], f"TCP {a} -> {b}: {b} saw {seen!r}, not {ips[a]}"
        seen = cluster.exec(ns, a, "sh", "-c", f"echo clientip | nc -u -w 2 {ips[b]} 8081")
        assert seen.strip().rsplit(":", 1)[0] == ips[a], f"UDP {a} -> {b}: {b} saw {seen!r}, not {ips[a]}"


def test_a_service_whose_endpoint_is_on_another_node(cluster: Cluster, ns: str, nodes: list[str]) -> None:
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
