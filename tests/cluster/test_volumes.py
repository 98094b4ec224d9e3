"""Volumes as users get them: a PVC of each StorageClass provisioned by external-provisioner when its pod is
scheduled, mounted and written; grown online (the pod can write more); grown while no pod used it (the next pod sees
the new size; ext4 grown offline); snapshotted and restored into a new claim with the data; deleted, and with it the
PV and the backing file or subvolume. Then an ephemeral inline volume."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from lightkube.utils.quantity import parse_quantity

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

DRIVER = "local.csi.nodeplug.io"
STATE = Path("/var/lib/nodeplug")
MOUNT = {"name": "data", "mountPath": "/data"}
# Online growth of ext4 is the EXT4_IOC_RESIZE_FS ioctl, which needs CAP_SYS_RESOURCE; the root of some sandboxes
# (this project's CI machines among them) lacks it, and then so does every container.
HAS_SYS_RESOURCE = bool(int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                                 if line.startswith("CapBnd:")), 16) & (1 << 24))  # fmt: skip


def claim(name: str, storage_class: str, size: str, source: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": storage_class,
        "resources": {"requests": {"storage": size}},
    }
    if source:
        spec["dataSource"] = source
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name}, "spec": spec}


def volume(claim_name: str) -> list[dict[str, Any]]:
    return [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}]


def backing(volume_id: str) -> list[Path]:
    """What holds the volume on the node: its loop file or btrfs subvolume (named by the volume's id)."""
    return [p for p in STATE.rglob(f"{volume_id}*") if "snapshots" not in p.parts]


def bound_pv(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    pvc = cluster.get("-n", ns, "pvc", name)
    assert pvc["status"]["phase"] == "Bound", pvc["status"]
    return cluster.get("pv", pvc["spec"]["volumeName"])  # type: ignore[no-any-return]


def write_mib(cluster: Cluster, ns: str, pod: str, mib: int) -> bool:
    """Whether the pod can write ``mib`` MiB more to its volume (the partial file removed either way)."""
    out = cluster.exec(ns, pod, "sh", "-c", f"dd if=/dev/zero of=/data/fill bs=1M count={mib} conv=fsync 2>&1 "
                       "&& echo WROTE; rm -f /data/fill; sync", timeout=120)  # fmt: skip
    return "WROTE" in out


@pytest.mark.parametrize("storage_class", ["nodeplug-local", "nodeplug-btrfs"])
def test_provision_write_snapshot_restore_delete(cluster: Cluster, ns: str, storage_class: str) -> None:
    cluster.apply(ns, claim("data", storage_class, "64Mi"),
                  cluster.pod("writer", volumeMounts=[MOUNT], volumes=volume("data")))  # fmt: skip
    cluster.wait_running(ns, "writer")
    pv = bound_pv(cluster, ns, "data")
    assert pv["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] == DRIVER
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "topology.local.csi.nodeplug.io/node"
    volume_id = pv["spec"]["csi"]["volumeHandle"]
    assert backing(volume_id), f"no loop file or subvolume for {volume_id} under {STATE}"
    cluster.exec(ns, "writer", "sh", "-c", "echo written-in-the-pod > /data/hello && sync")

    cluster.volume_snapshot(ns, "snap", "data")
    source = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}
    cluster.apply(ns, claim("restored", storage_class, "64Mi", source),
                  cluster.pod("reader", volumeMounts=[MOUNT], volumes=volume("restored")))  # fmt: skip
    cluster.wait_running(ns, "reader")
    assert cluster.exec(ns, "reader", "cat", "/data/hello").strip() == "written-in-the-pod"
    restored_id = bound_pv(cluster, ns, "restored")["spec"]["csi"]["volumeHandle"]
    assert restored_id != volume_id

    cluster.kubectl("-n", ns, "delete", "pod", "writer", "reader", "--wait=true", timeout=120)
    cluster.kubectl("-n", ns, "delete", "volumesnapshot", "snap", "--wait=true", timeout=120)
    cluster.kubectl("-n", ns, "delete", "pvc", "data", "restored", "--wait=true", timeout=120)
    cluster.wait("PV deleted", lambda: not cluster.kubectl("get", "pv", pv["metadata"]["name"], "--ignore-not-found"),
                 120)  # fmt: skip
    cluster.wait("backing files removed", lambda: not backing(volume_id) and not backing(restored_id), 60,
                 explain=f"left: {backing(volume_id) + backing(restored_id)}")  # fmt: skip


@pytest.fixture(scope="module")
def xfs_class(cluster: Cluster) -> Iterator[str]:
    """nodeplug-local with xfs (xfs_growfs needs no CAP_SYS_RESOURCE): a loop-file volume grown online here."""
    name = "t-nodeplug-local-xfs"
    sc = cluster.get("storageclass", "nodeplug-local")
    sc["metadata"] = {"name": name}
    sc["parameters"]["csi.storage.k8s.io/fstype"] = "xfs"
    cluster.apply("default", sc)
    yield name
    cluster.kubectl("delete", "storageclass", name, "--ignore-not-found")


@pytest.mark.parametrize("storage_class", ["nodeplug-local", "xfs", "nodeplug-btrfs"])
def test_expand_online(cluster: Cluster, ns: str, storage_class: str, request: pytest.FixtureRequest) -> None:
    if storage_class == "nodeplug-local" and not HAS_SYS_RESOURCE:
        pytest.skip("online ext4 growth needs CAP_SYS_RESOURCE, which this machine's root lacks (xfs: see [xfs])")
    if storage_class == "xfs":
        storage_class = request.getfixturevalue("xfs_class")
    cluster.apply(ns, claim("data", storage_class, "64Mi"),
                  cluster.pod("app", volumeMounts=[MOUNT], volumes=volume("data")))  # fmt: skip
    cluster.wait_running(ns, "app")
    # The driver may round the request up (xfs needs 300 MiB): go by the capacity the claim got.
    size = mib(cluster.get("-n", ns, "pvc", "data")["status"]["capacity"]["storage"])
    assert not write_mib(cluster, ns, "app", size + 32), f"a {size} MiB volume took {size + 32} MiB"
    grown = f"{size + 128}Mi"
    patch = json.dumps({"spec": {"resources": {"requests": {"storage": grown}}}})
    cluster.kubectl("-n", ns, "patch", "pvc", "data", "-p", patch)
    cluster.wait(f"PVC capacity {grown}", lambda: mib(cluster.get("-n", ns, "pvc", "data")["status"]
                 .get("capacity", {}).get("storage", "0")) >= size + 128, 120,
                 explain=cluster.kubectl("-n", ns, "get", "events", check=False))  # fmt: skip
    assert write_mib(cluster, ns, "app", size + 32), f"the grown volume does not take {size + 32} MiB"
    status = cluster.get("-n", ns, "pod", "app")["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"]  # the same container: grown under it


def test_expand_while_unused_then_the_next_pod_sees_it(cluster: Cluster, ns: str) -> None:
    """nodeplug-local (ext4) grown while no pod uses it: when the next pod mounts it, NodeStageVolume reads the new
    size from the claim's PV and grows the volume, its filesystem offline before mounting it (no CAP_SYS_RESOURCE
    needed), and kubelet's NodeExpandVolume (1.32: after publishing) finds it grown."""
    cluster.apply(ns, claim("data", "nodeplug-local", "64Mi"),
                  cluster.pod("first", volumeMounts=[MOUNT], volumes=volume("data")))  # fmt: skip
    cluster.wait_running(ns, "first")
    cluster.exec(ns, "first", "sh", "-c", "echo kept > /data/f && sync")
    size = mib(cluster.get("-n", ns, "pvc", "data")["status"]["capacity"]["storage"])
    cluster.kubectl("-n", ns, "delete", "pod", "first", "--wait=true", timeout=120)
    grown = size + 128
    patch = json.dumps({"spec": {"resources": {"requests": {"storage": f"{grown}Mi"}}}})
    cluster.kubectl("-n", ns, "patch", "pvc", "data", "-p", patch)
    # external-resizer records the new size in the PV; the node grows it when a pod next mounts the claim
    cluster.wait("the PV's new capacity", lambda: mib(bound_pv(cluster, ns, "data")["spec"]["capacity"]["storage"])
                 >= grown, 120, explain=cluster.kubectl("-n", ns, "get", "events", check=False))  # fmt: skip
    cluster.apply(ns, cluster.pod("second", volumeMounts=[MOUNT], volumes=volume("data")))
    cluster.wait_running(ns, "second")
    cluster.wait(f"PVC capacity {grown}Mi", lambda: mib(cluster.get("-n", ns, "pvc", "data")["status"]
                 .get("capacity", {}).get("storage", "0")) >= grown, 120,
                 explain=cluster.kubectl("-n", ns, "get", "events", check=False))  # fmt: skip
    total_kib = int(cluster.exec(ns, "second", "sh", "-c", "df -k /data | tail -1").split()[1])
    assert total_kib > (size + 100) * 1024, total_kib
    assert cluster.exec(ns, "second", "cat", "/data/f").strip() == "kept"
    assert write_mib(cluster, ns, "second", size + 32), f"the grown volume does not take {size + 32} MiB"


def mib(quantity: str) -> int:
    return int(parse_quantity(quantity) or 0) >> 20


def volumes_on_node() -> set[str]:
    return {p.name for p in STATE.rglob("volumes/*")}


def test_ephemeral_inline_volume(cluster: Cluster, ns: str) -> None:
    before = volumes_on_node()
    inline = [{"name": "data", "csi": {"driver": DRIVER, "volumeAttributes": {"size": "32Mi"}}}]
    cluster.apply(ns, cluster.pod("scratch", volumeMounts=[MOUNT], volumes=inline))
    cluster.wait_running(ns, "scratch")
    out = cluster.exec(ns, "scratch", "sh", "-c", "echo hi > /data/f && cat /data/f && df -k /data | tail -1")
    lines = out.strip().split("\n")
    assert lines[0] == "hi"
    assert 16 * 1024 < int(lines[1].split()[1]) <= 32 * 1024, lines[1]
    created = volumes_on_node() - before
    assert len(created) == 1, created
    uid = cluster.get("-n", ns, "pod", "scratch")["metadata"]["uid"]
    mount = f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~csi/data/mount"
    assert mount in Path("/proc/self/mountinfo").read_text()
    cluster.kubectl("-n", ns, "delete", "pod", "scratch", "--wait=true", timeout=120)
    # The volume lives and dies with the pod.
    cluster.wait("inline volume removed", lambda: mount not in Path("/proc/self/mountinfo").read_text()
                 and not created & volumes_on_node(), 60)  # fmt: skip
