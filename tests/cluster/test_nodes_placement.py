"""Volumes and devices on several real nodes (``NODEPLUG_TEST_NODES=3``), as a user meets them: a
WaitForFirstConsumer claim of each StorageClass is provisioned on the node its pod was scheduled to (the PV's
topology names that node, the volume's backing is in that node's ``/var/lib/nodeplug`` and no other's, and the pod
stores data on it); every node publishes one ResourceSlice pool of its own, and a claim's pod runs on the node whose
pool the scheduler allocated from, with the claim prepared there. Skipped on a one-node cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from support.clusterdra import DRIVER, pod_claim

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

TOPOLOGY_KEY = "topology.local.csi.nodeplug.io/node"
MOUNT = {"name": "data", "mountPath": "/data"}


@pytest.fixture
def nodes(cluster: Cluster) -> list[str]:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=1; by default the tier runs on three)")
    return cluster.nodes


def claim(name: str, storage_class: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
                     "resources": {"requests": {"storage": "64Mi"}}}}  # fmt: skip


def on(node: str) -> dict[str, Any]:
    """What places a pod on ``node`` through the scheduler (not ``nodeName``, which would bypass it)."""
    return {"nodeSelector": {"kubernetes.io/hostname": node}}


def backing_on(cluster: Cluster, node: str, volume_id: str) -> list[str]:
    """The loop file or btrfs subvolume of ``volume_id`` in ``node``'s own /var/lib/nodeplug."""
    out = cluster.on_node(node, "find", "/var/lib/nodeplug", "-name", f"{volume_id}*", "-not", "-path", "*/snapshots/*")
    return out.split()


@pytest.mark.parametrize("storage_class", ["nodeplug-local", "nodeplug-btrfs"])
def test_a_wait_for_first_consumer_claim_lands_on_its_pods_node(
    cluster: Cluster, ns: str, nodes: list[str], storage_class: str
) -> None:
    sc = cluster.get("storageclass", storage_class)
    assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
    pods = {node: f"w{k}" for k, node in enumerate(nodes)}
    objects = []
    for node, pod in pods.items():
        objects.append(claim(pod, storage_class))
        writes = f"echo {node} > /data/node && sync && trap 'exit 0' TERM; sleep 3600 & wait"
        objects.append(cluster.pod(pod, "sh", "-c", writes, volumeMounts=[MOUNT],
                                   volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": pod}}],
                                   **on(node)))  # fmt: skip
    cluster.apply(ns, *objects)
    cluster.wait_running(ns, *pods.values(), timeout=180)
    for node, pod in pods.items():
        assert cluster.get("-n", ns, "pod", pod)["spec"]["nodeName"] == node
        pvc = cluster.get("-n", ns, "pvc", pod)
        assert pvc["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] == node
        only_on(cluster, nodes, node, pvc["spec"]["volumeName"])
        assert cluster.exec(ns, pod, "cat", "/data/node").strip() == node
    cluster.kubectl("-n", ns, "delete", "pod", *pods.values(), "--wait=true", timeout=180)
    cluster.kubectl("-n", ns, "delete", "pvc", *pods.values(), "--wait=true", timeout=180)


def only_on(cluster: Cluster, nodes: list[str], node: str, pv_name: str, what: str = "") -> None:
    """PersistentVolume ``pv_name`` is pinned to ``node`` (its node affinity) and its backing is in that node's
    /var/lib/nodeplug and no other node's (``what`` prefixes the messages)."""
    pv = cluster.get("pv", pv_name)
    (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": TOPOLOGY_KEY, "operator": "In", "values": [node]}], term
    volume_id = pv["spec"]["csi"]["volumeHandle"]
    assert backing_on(cluster, node, volume_id), f"{what}{volume_id} not in {node}'s /var/lib/nodeplug"
    elsewhere = {other: backing_on(cluster, other, volume_id) for other in nodes if other != node}
    assert not any(elsewhere.values()), f"{what}{volume_id} of {node} also on {elsewhere}"


def fuse_pools(cluster: Cluster) -> dict[str, tuple[str, int]]:
    """Per node name: the pool its fuse devices are offered in and how many there are."""
    out: dict[str, tuple[str, int]] = {}
    for s in cluster.get("resourceslices")["items"]:
        spec = s["spec"]
        if spec["driver"] != DRIVER:
            continue
        fuse = [d for d in spec["devices"] if d["basic"]["attributes"]["resource"]["string"] == "fuse"]
        if fuse:
            pool, count = out.get(spec["nodeName"], (spec["pool"]["name"], 0))
            out[spec["nodeName"]] = (pool, count + len(fuse))
    return out


def test_each_node_its_own_pool_and_a_claims_pod_runs_where_its_device_is(
    cluster: Cluster, ns: str, nodes: list[str]
) -> None:
    every = {node: (node, 16) for node in nodes}  # /dev/fuse offered as 16 replicas, in a pool named for the node
    cluster.wait("a fuse pool per node", lambda: fuse_pools(cluster) == every, 120,
                 explain=f"pools: {fuse_pools(cluster)}")  # fmt: skip
    template = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "fuse"},
        "spec": {"spec": {"devices": {"requests": [{"name": "dev", "deviceClassName": "fuse.devices.nodeplug.io"}]}}},
    }
    pods = {node: f"c{k}" for k, node in enumerate(nodes)}
    objects: list[dict[str, Any]] = [template]
    for node, name in pods.items():
        pod = cluster.pod(name, resources={"claims": [{"name": "dev"}]}, **on(node))
        pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": "fuse"}]
        objects.append(pod)
    # and one the scheduler places wherever it likes
    free = cluster.pod("anywhere", resources={"claims": [{"name": "dev"}]})
    del free["spec"]["nodeSelector"]
    free["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": "fuse"}]
    cluster.apply(ns, *objects, free)
    cluster.wait_running(ns, *pods.values(), "anywhere", timeout=180)
    for name in [*pods.values(), "anywhere"]:
        node = cluster.get("-n", ns, "pod", name)["spec"]["nodeName"]
        c = pod_claim(cluster, ns, name)
        (result,) = c["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, node), f"{name} on {node}: {result}"
        (term,) = c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
        assert term == {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}, term
        # prepared by that node's agent: the claim's CDI spec is in that node's /var/run/cdi
        spec = f"/var/run/cdi/k8s.{DRIVER}-claim_{c['metadata']['uid']}.json"
        cluster.on_node(node, "test", "-f", spec)
        cluster.exec(ns, name, "sh", "-c", "exec 3<>/dev/fuse")
    cluster.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", timeout=180)


def using(cluster: Cluster, name: str, claim_name: str, node: str) -> dict[str, Any]:
    """A pod on ``node`` (placed by the scheduler) with the claim mounted at /data."""
    return cluster.pod(name, volumeMounts=[MOUNT], **on(node),
                       volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}])  # fmt: skip


def snapshots_on(cluster: Cluster, node: str, snapshot_id: str) -> list[str]:
    """What holds the snapshot ``snapshot_id`` in ``node``'s own /var/lib/nodeplug."""
    return cluster.on_node(node, "find", "/var/lib/nodeplug", "-path", "*/snapshots/*", "-name", f"{snapshot_id}*",
                           "-prune").split()  # fmt: skip


@pytest.mark.parametrize("storage_class", ["nodeplug-local", "nodeplug-btrfs"])
def test_a_snapshot_and_a_clone_stay_on_their_node(
    cluster: Cluster, ns: str, nodes: list[str], storage_class: str
) -> None:
    node = nodes[-1]  # not the first: its paths are the machine's own
    source = claim("data", storage_class)
    writer = using(cluster, "writer", "data", node)
    cluster.apply(ns, source, writer)
    cluster.wait_running(ns, "writer", timeout=180)
    cluster.exec(ns, "writer", "sh", "-c", f"echo from-{node} > /data/f && sync")
    snap = cluster.volume_snapshot(ns, "snap", "data")
    content = cluster.get("volumesnapshotcontent", snap["status"]["boundVolumeSnapshotContentName"])
    snapshot_id = content["status"]["snapshotHandle"]
    assert snapshots_on(cluster, node, snapshot_id), f"snapshot {snapshot_id} not in {node}'s /var/lib/nodeplug"
    elsewhere = {other: snapshots_on(cluster, other, snapshot_id) for other in nodes if other != node}
    assert not any(elsewhere.values()), f"snapshot {snapshot_id} of {node} also on {elsewhere}"

    restored = claim("restored", storage_class)
    restored["spec"]["dataSource"] = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}
    clone = claim("clone", storage_class)
    clone["spec"]["dataSource"] = {"kind": "PersistentVolumeClaim", "name": "data"}
    cluster.apply(
        ns, restored, clone, using(cluster, "restored", "restored", node), using(cluster, "clone", "clone", node)
    )
    cluster.wait_running(ns, "restored", "clone", timeout=180)
    for name in ("restored", "clone"):
        only_on(cluster, nodes, node, cluster.get("-n", ns, "pvc", name)["spec"]["volumeName"], f"{name} ")
        assert cluster.exec(ns, name, "cat", "/data/f").strip() == f"from-{node}"
    cluster.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", timeout=180)
    cluster.kubectl("-n", ns, "delete", "volumesnapshot", "snap", "--wait=true", timeout=180)
    cluster.kubectl("-n", ns, "delete", "pvc", "--all", "--wait=true", timeout=180)
