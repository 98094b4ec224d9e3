"""Importing snapshots and volumes as the README says, on the real cluster with the node-local csi-snapshotter: a
snapshot whose API objects are gone (its VolumeSnapshot deleted with deletionPolicy Retain, its content deleted: as
after a re-created cluster) is imported by a hand-written VolumeSnapshotContent naming its handle, becomes ready and
restores into a new claim with its data; a content naming a snapshot no node has gets a SnapshotNotFound Event. And
the property upstream's volumeMode spec "should not mount / map unused volumes in a pod" checks (its hostexec pod
cannot enter PID 1's mount namespace here): a pod's claims that no container uses are neither mounted nor mapped
into the pod's directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

DRIVER = "local.csi.nodeplug.io"
LABEL = "snapshot.storage.kubernetes.io/managed-by"
SNAP_API = "snapshot.storage.k8s.io/v1"
MOUNT = {"name": "data", "mountPath": "/data"}


def claim(name: str, storage_class: str, size: str, source: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
                            "resources": {"requests": {"storage": size}}}  # fmt: skip
    if source:
        spec["dataSource"] = source
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name}, "spec": spec}


def volume(claim_name: str) -> list[dict[str, Any]]:
    return [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}]


def snapshot_status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return dict(cluster.get("-n", ns, "volumesnapshot", name).get("status") or {})


def imported(ns: str, name: str, handle: str, policy: str = "Delete") -> list[dict[str, Any]]:
    """The README's import: a VolumeSnapshotContent naming the snapshot by handle, and a VolumeSnapshot bound to it."""
    content = {"apiVersion": SNAP_API, "kind": "VolumeSnapshotContent", "metadata": {"name": f"{ns}-{name}"},
               "spec": {"driver": DRIVER, "deletionPolicy": policy, "source": {"snapshotHandle": handle},
                        "volumeSnapshotClassName": "nodeplug-snapshot",
                        "volumeSnapshotRef": {"namespace": ns, "name": name}}}  # fmt: skip
    snap = {"apiVersion": SNAP_API, "kind": "VolumeSnapshot", "metadata": {"name": name, "namespace": ns},
            "spec": {"source": {"volumeSnapshotContentName": f"{ns}-{name}"}}}  # fmt: skip
    return [content, snap]


def test_a_snapshot_whose_objects_are_gone_is_imported_and_restored(cluster: Cluster, ns: str) -> None:
    retain = cluster.get("volumesnapshotclass", "nodeplug-snapshot")
    retain["metadata"] = {"name": f"{ns}-retain"}
    retain["deletionPolicy"] = "Retain"
    cluster.apply("default", retain)
    try:
        cluster.apply(ns, claim("data", "nodeplug-local", "64Mi"),
                      cluster.pod("writer", volumeMounts=[MOUNT], volumes=volume("data")))  # fmt: skip
        cluster.wait_running(ns, "writer")
        cluster.exec(ns, "writer", "sh", "-c", "echo taken-before > /data/hello && sync")
        cluster.apply(ns, {"apiVersion": SNAP_API, "kind": "VolumeSnapshot", "metadata": {"name": "before"},
                           "spec": {"volumeSnapshotClassName": f"{ns}-retain",
                                    "source": {"persistentVolumeClaimName": "data"}}})  # fmt: skip
        cluster.wait("snapshot ready", lambda: snapshot_status(cluster, ns, "before").get("readyToUse") is True, 120)
        content_name = snapshot_status(cluster, ns, "before")["boundVolumeSnapshotContentName"]
        handle = cluster.get("volumesnapshotcontent", content_name)["status"]["snapshotHandle"]
        # Its API objects go (Retain: the snapshot itself stays on the node), and the writer with its claim.
        cluster.kubectl("-n", ns, "delete", "volumesnapshot", "before", "--wait=true", timeout=120)
        cluster.kubectl("delete", "volumesnapshotcontent", content_name, "--wait=true", timeout=120)
        cluster.kubectl("-n", ns, "delete", "pod", "writer", "--wait=true", timeout=120)
        cluster.kubectl("-n", ns, "delete", "pvc", "data", "--wait=true", timeout=120)
    finally:
        cluster.kubectl("delete", "volumesnapshotclass", f"{ns}-retain", "--ignore-not-found")

    cluster.apply(ns, *imported(ns, "after", handle))
    cluster.wait("the imported snapshot ready", lambda: snapshot_status(cluster, ns, "after").get("readyToUse") is True,
                 120, explain=cluster.kubectl("get", "events", "-A", check=False)[-3000:])  # fmt: skip
    content = cluster.get("volumesnapshotcontent", f"{ns}-after")
    assert content["metadata"]["labels"][LABEL] == cluster.node  # adopted by the node holding it
    assert content["status"]["snapshotHandle"] == handle
    source = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "after"}
    cluster.apply(ns, claim("restored", "nodeplug-local", "64Mi", source),
                  cluster.pod("reader", volumeMounts=[MOUNT], volumes=volume("restored")))  # fmt: skip
    cluster.wait_running(ns, "reader")
    assert cluster.exec(ns, "reader", "cat", "/data/hello").strip() == "taken-before"
    # deletionPolicy Delete: deleting the imported snapshot deletes the snapshot on the node
    cluster.kubectl("-n", ns, "delete", "volumesnapshot", "after", "--wait=true", timeout=120)
    cluster.wait("the content deleted", lambda: not cluster.kubectl("get", "volumesnapshotcontent", f"{ns}-after",
                                                                     "--ignore-not-found"), 120)  # fmt: skip
    assert not list(Path("/var/lib/nodeplug").rglob(f"*{handle}*"))


def test_a_content_naming_a_snapshot_no_node_has_gets_an_event(cluster: Cluster, ns: str) -> None:
    missing = "snap-" + "0" * 32
    cluster.apply(ns, *imported(ns, "nowhere", missing, policy="Retain"))
    content = f"{ns}-nowhere"
    try:

        def told() -> list[dict[str, Any]]:
            out = cluster.kubectl("get", "events.events.k8s.io", "-A", "-o", "json",
                                  f"--field-selector=regarding.name={content}")  # fmt: skip
            return [e for e in json.loads(out)["items"] if e["reason"] == "SnapshotNotFound"]

        cluster.wait("SnapshotNotFound on the content", lambda: bool(told()), 120)
        (ev,) = told()
        assert ev["type"] == "Warning" and missing in ev["note"], ev
        assert ev["regarding"]["kind"] == "VolumeSnapshotContent"
        assert LABEL not in (cluster.get("volumesnapshotcontent", content)["metadata"].get("labels") or {})
        assert snapshot_status(cluster, ns, "nowhere").get("readyToUse") is not True
    finally:
        cluster.kubectl("-n", ns, "delete", "volumesnapshot", "nowhere", "--wait=false", check=False)
        cluster.kubectl("delete", "volumesnapshotcontent", content, "--wait=false", check=False)


def test_claims_no_container_uses_are_neither_mounted_nor_mapped(cluster: Cluster, ns: str) -> None:
    block = claim("raw", "nodeplug-local", "32Mi")
    block["spec"]["volumeMode"] = "Block"
    used = {"name": "used", "mountPath": "/data"}
    vols = [{"name": "used", "persistentVolumeClaim": {"claimName": "used"}},
            {"name": "fs", "persistentVolumeClaim": {"claimName": "fs"}},
            {"name": "raw", "persistentVolumeClaim": {"claimName": "raw"}}]  # fmt: skip
    cluster.apply(ns, claim("used", "nodeplug-local", "32Mi"), claim("fs", "nodeplug-local", "32Mi"), block,
                  cluster.pod("idle", volumeMounts=[used], volumes=vols))  # fmt: skip
    cluster.wait_running(ns, "idle")
    uid = cluster.get("-n", ns, "pod", "idle")["metadata"]["uid"]
    pod_dir = Path("/var/lib/kubelet/pods") / uid
    pvs = {c: cluster.get("-n", ns, "pvc", c)["spec"]["volumeName"] for c in ("used", "fs", "raw")}
    # as upstream looks: <pod>/volumes/<plugin>/<volume> and <pod>/volumeDevices/<plugin>/<volume>
    listed = [str(p.relative_to(pod_dir)) for d in ("volumes", "volumeDevices") for p in (pod_dir / d).glob("*/*")]
    csi = sorted(p for p in listed if "kubernetes.io~csi" in p)
    assert csi == [f"volumes/kubernetes.io~csi/{pvs['used']}"], listed  # the used claim only: the check can fail
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"{pod_dir}/volumes/kubernetes.io~csi/{pvs['used']}/mount" in mounts
    for unused in ("fs", "raw"):
        assert f"{pod_dir}/volumes/kubernetes.io~csi/{pvs[unused]}" not in mounts
        assert f"{pod_dir}/volumeDevices/kubernetes.io~csi/{pvs[unused]}" not in mounts
