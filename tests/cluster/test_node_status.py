"""What the agent tells an operator about its node, on a default install: the Node's NetworkUnavailable condition
cleared once the pod network is routed (as pod networks do, since cloud node controllers set it at registration), and
a hostile Node's podCIDR refused with an Event that ``kubectl describe node`` shows."""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type


def test_the_nodes_network_is_available_by_nodeplugs_word(cluster: Cluster) -> None:
    def condition() -> dict[str, str]:
        conditions = cluster.get("node", cluster.node)["status"].get("conditions", [])
        return next((c for c in conditions if c["type"] == "NetworkUnavailable"), {})

    cluster.wait("NetworkUnavailable set by the agent", lambda: bool(condition()), 120)
    got = condition()
    assert got["status"] == "False" and got["reason"] == "NodeplugRoutesProgrammed", got


def test_a_peer_podcidr_outside_the_cluster_cidrs_is_refused_and_described_on_its_node(cluster: Cluster) -> None:
    """A Node (made by hand: an operator's typo, or anyone with write access to Nodes) whose podCIDR lies in the
    Service range, outside the cluster CIDRs the shipped config names: the agent routes nothing to it and says why
    on that Node."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "typo-node"},
            "spec": {"podCIDR": "10.96.7.0/24", "podCIDRs": ["10.96.7.0/24"]}}  # fmt: skip
    cluster.kubectl("create", "-f", "-", input=json.dumps(node))
    try:
        cluster.wait("the agent's PodCIDRNotRouted Event on typo-node", lambda: "PodCIDRNotRouted" in cluster.kubectl(
            "describe", "node", "typo-node"), 60)  # fmt: skip
        described = cluster.kubectl("describe", "node", "typo-node")
        assert "outside cluster_network.cluster_cidrs" in described and "nodeplug" in described, described
    finally:
        with contextlib.suppress(AssertionError):
            cluster.kubectl("delete", "node", "typo-node", "--wait=false")
