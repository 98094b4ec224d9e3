"""Storage capacity steering on several real nodes (``NODEPLUG_TEST_NODES=3``): each node's agent reports what its
btrfs filesystem can still give (GetCapacity, published by its csi-provisioner as CSIStorageCapacity objects); once
one node's is used up by a claim, the scheduler places the next WaitForFirstConsumer claim's pod on a node that has
room, even against the pod's own preference for the full node, and a pod that may only run on the full node waits
with the scheduler saying why. Skipped on a one-node cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from lightkube.utils.quantity import parse_quantity

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

TOPOLOGY_KEY = "topology.local.csi.nodeplug.io/node"
CLASS = "nodeplug-btrfs"
MOUNT = {"name": "data", "mountPath": "/data"}
MI = 1 << 20
# csi-provisioner refreshes CSIStorageCapacity once a minute (--capacity-poll-interval's default).
POLL_BOUND = 240


def capacity(cluster: Cluster, node: str) -> int:
    """What node's CSIStorageCapacity for the btrfs class says (0 when there is none yet)."""
    objs = cluster.get("-n", "nodeplug-system", "csistoragecapacities")["items"]
    mine = [o for o in objs if o.get("storageClassName") == CLASS
            and (o.get("nodeTopology") or {}).get("matchLabels", {}).get(TOPOLOGY_KEY) == node]  # fmt: skip
    return max((int(parse_quantity(o.get("capacity", "0")) or 0) for o in mine), default=0)


def claim(name: str, size: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": CLASS,
                     "resources": {"requests": {"storage": f"{size // MI}Mi"}}}}  # fmt: skip


def volumes(name: str) -> dict[str, Any]:
    return {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}], "volumeMounts": [MOUNT]}


def test_a_full_node_is_passed_over_for_the_next_claim(cluster: Cluster, ns: str) -> None:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=1; by default the tier runs on three)")
    full, spare = cluster.nodes[0], cluster.nodes[1]
    cluster.wait("every node's btrfs capacity published", lambda: min(capacity(cluster, n) for n in (full, spare))
                 > 0, POLL_BOUND)  # fmt: skip
    room = capacity(cluster, full)
    # The first claim takes a little over half of the full node's room: the same claim again fits on a node with all
    # its room and not on that node any more.
    size = (room // 2 // MI + 16) * MI
    assert capacity(cluster, spare) >= size, f"{spare} has no room for a {size // MI}Mi claim to start with"
    cluster.apply(ns, claim("first", size), cluster.pod("first", **volumes("first"),
                                                        nodeSelector={"kubernetes.io/hostname": full}))  # fmt: skip
    cluster.wait_running(ns, "first", timeout=180)
    cluster.wait(f"{full}'s capacity below {size // MI}Mi", lambda: capacity(cluster, full) < size, POLL_BOUND,
                 explain=f"(still {capacity(cluster, full) // MI}Mi)")  # fmt: skip

    # Allowed on both nodes and preferring the full one: the scheduler's capacity check sends it to the other.
    affinity = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [full, spare]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [full]}]}}]}}  # fmt: skip
    steered = cluster.pod("steered", **volumes("steered"), affinity=affinity)
    del steered["spec"]["nodeSelector"]
    cluster.apply(ns, claim("steered", size), steered)
    cluster.wait_running(ns, "steered", timeout=180)
    assert cluster.get("-n", ns, "pod", "steered")["spec"]["nodeName"] == spare
    pv = cluster.get("pv", cluster.get("-n", ns, "pvc", "steered")["spec"]["volumeName"])
    (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": TOPOLOGY_KEY, "operator": "In", "values": [spare]}]
    cluster.exec(ns, "steered", "sh", "-c", "echo here > /data/f && sync && cat /data/f")

    # Only the full node allowed: the pod waits, its claim unprovisioned, and the scheduler says why.
    cluster.apply(ns, claim("stuck", size), cluster.pod("stuck", **volumes("stuck"),
                                                        nodeSelector={"kubernetes.io/hostname": full}))  # fmt: skip

    def refused() -> bool:
        events = cluster.get("-n", ns, "events", "--field-selector", "involvedObject.name=stuck")["items"]
        return any(e.get("reason") == "FailedScheduling" and "enough free storage" in e.get("message", "")
                   for e in events)  # fmt: skip

    cluster.wait("the scheduler refusing the full node for lack of storage", refused, 120)
    assert cluster.get("-n", ns, "pod", "stuck")["status"]["phase"] == "Pending"
    assert cluster.get("-n", ns, "pvc", "stuck")["status"]["phase"] == "Pending"
    cluster.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", timeout=180)
