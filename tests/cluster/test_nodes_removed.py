"""A node removed from a cluster of several (``NODEPLUG_TEST_NODES=3``): once its Node object is deleted, the routes
to its pods leave every other node; its kubelet started again registers it anew and the other nodes route to its
podCIDR again. Skipped on a one-node cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type


def test_a_deleted_nodes_routes_leave_the_other_nodes(cluster: Cluster) -> None:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=3 runs the tier on three)")
    gone, *others = cluster.nodes[::-1]
    cidr = cluster.get("node", gone)["spec"]["podCIDR"]
    for node in others:
        cluster.wait(f"{node}'s route to {gone}'s {cidr}", lambda: cidr in cluster.cluster_routes(node), 60)  # noqa: B023
    cluster.kubectl("delete", "node", gone, "--wait=true")
    try:
        for node in others:
            cluster.wait(f"{node}'s route to the deleted {gone}'s {cidr} removed",
                         lambda: cidr not in cluster.cluster_routes(node), 60,  # noqa: B023
                         explain=str(cluster.cluster_routes(node)))  # fmt: skip
    finally:
        # The node comes back as a machine does: its kubelet, started again, registers it.
        cluster.restart(f"kubelet-{gone}")
        cluster.wait(f"{gone} registered again", lambda: bool(cluster.kubectl("get", "node", gone, check=False)), 60)
        cluster.kubectl("wait", "--for=condition=Ready", f"node/{gone}", "--timeout=120s", timeout=150)
        cluster.rollout()
    back = cluster.get("node", gone)["spec"]["podCIDR"]
    for node in others:
        cluster.wait(f"{node}'s route to {gone}'s {back} again", lambda: back in cluster.cluster_routes(node), 60)  # noqa: B023
