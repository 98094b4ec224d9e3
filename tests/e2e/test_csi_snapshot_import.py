"""Pre-provisioned VolumeSnapshotContents against a real kube-apiserver (lab.dralab's control plane, with the
upstream snapshot CRDs from KUBE_ASSETS and daemonset/rbac.yaml's roles and admission policies): the agent, with a
token of its service account bound to its Node, adopts a content naming a snapshot it holds by setting the label the
node-local csi-snapshotter selects, reports one naming a snapshot nobody holds with an Event on the content and its
VolumeSnapshot, and may not touch what is not its node's."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

from lab.controlplane import missing_assets
from lab.dralab import NODE, Cluster
from lab.kubeassets import absent, kube_assets
from lab.netns import Netns
from support.csidriver import cap, cleanup_under
from support.host import REPO
from support.wait import running, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok"),
    pytest.mark.skipif(not (kube_assets() / "csi" / "crd").is_dir(), reason=absent("csi/crd") or "ok"),
]

DRIVER = "local.csi.nodeplug.io"
LABEL = "snapshot.storage.kubernetes.io/managed-by"
CONTENTS = "/apis/snapshot.storage.k8s.io/v1/volumesnapshotcontents"
OTHER = "other-node"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    work = Path(tempfile.mkdtemp(prefix="npsi-", dir="/tmp"))
    ns = Netns("npsi" + uuid.uuid4().hex[:6])
    c: Cluster | None = None
    try:
        c = Cluster(work, ns)
        for crd in sorted((kube_assets() / "csi" / "crd").glob("snapshot.storage.k8s.io_*.yaml")):
            c.api.ok("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(crd.read_text()))
        for doc in yaml.safe_load_all((REPO / "daemonset/rbac.yaml").read_text()):
            if doc and doc["kind"] != "ServiceAccount":
                c.api.create(doc)
        # kubelet writes each node's CSINode; here this node's agent and one other node run the driver
        for node in (NODE, OTHER):
            c.api.create({"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": node},
                          "spec": {"drivers": [{"name": DRIVER, "nodeID": node}]}})  # fmt: skip
        wait_for("the CRDs served", lambda: c is not None and c.api.request("GET", CONTENTS)[0] == 200, timeout=60)
        yield c
    finally:
        if c is not None:
            c.cp.close()
        ns.delete()
        shutil.rmtree(work, ignore_errors=True)


class CsiAgent:
    """``nodeplug agent`` with only the CSI driver, in the control plane's netns, on a temporary root."""

    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.root = root
        self.log = root / "agent.log"
        config = root / "agent.yaml"
        config.write_text("http: {address: 127.0.0.1:0}\nshutdown_grace_seconds: 2\ncni: {enabled: false}\n"
                          "deviceplugin: {enabled: false}\ncsi: {registration_enabled: false}\n")  # fmt: skip
        argv = [sys.executable, "-m", "nodeplug.cli", "agent", "--config", str(config), "--root", str(root),
                "--kubeconfig", str(cluster.kubeconfig), "--node-name", NODE]  # fmt: skip
        self.socket = root / f"var/lib/kubelet/plugins/{DRIVER}/csi.sock"
        self.proc = cluster.ns.popen(argv, self.log)
        wait_for("the CSI socket", lambda: running(self.proc, self.log) and self.socket.exists(), timeout=60)

    async def snapshot(self, name: str) -> str:
        """A volume and a snapshot of it, made as external-provisioner and csi-snapshotter make them; its ID."""
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as ch:
            ctl = csi_pb2_grpc.ControllerStub(ch)
            vol = await ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
                name=f"pvc-{name}", capacity_range=csi_pb2.CapacityRange(required_bytes=32 << 20),
                volume_capabilities=[cap()]))  # fmt: skip
            snap = await ctl.CreateSnapshot(
                csi_pb2.CreateSnapshotRequest(name=f"snapshot-{name}", source_volume_id=vol.volume.volume_id)
            )
        return str(snap.snapshot.snapshot_id)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def agent(cluster: Cluster) -> Iterator[CsiAgent]:
    root = Path(tempfile.mkdtemp(prefix="npsa-", dir="/tmp"))
    a: CsiAgent | None = None
    try:
        a = CsiAgent(cluster, root)
        yield a
    finally:
        if a is not None:
            a.stop()
        cleanup_under(root)
        shutil.rmtree(root, ignore_errors=True)


def content(name: str, handle: str, driver: str = DRIVER, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A VolumeSnapshotContent as a user writes one to import a snapshot, bound to VolumeSnapshot default/<name>."""
    return {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
            "metadata": {"name": name, **({"labels": labels} if labels else {})},
            "spec": {"driver": driver, "deletionPolicy": "Retain", "source": {"snapshotHandle": handle},
                     "volumeSnapshotRef": {"namespace": "default", "name": name}}}  # fmt: skip


def owner(cluster: Cluster, name: str) -> str:
    labels = cluster.api.ok("GET", f"{CONTENTS}/{name}")["metadata"].get("labels") or {}
    return str(labels.get(LABEL, ""))


def events_about(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    path = f"/apis/events.k8s.io/v1/namespaces/{namespace}/events?fieldSelector=regarding.name%3D{name}"
    return list(cluster.api.ok("GET", path)["items"])


def test_a_content_naming_this_nodes_snapshot_is_adopted(cluster: Cluster, agent: CsiAgent) -> None:
    sid = asyncio.run(agent.snapshot("held"))
    cluster.api.create(content("import-held", sid))
    wait_for("the content labelled for this node", lambda: owner(cluster, "import-held") == NODE, timeout=60)
    got = cluster.api.ok("GET", f"{CONTENTS}/import-held")
    assert got["spec"]["source"] == {"snapshotHandle": sid}  # nothing else changed

    def adopted() -> bool:
        return any(e["reason"] == "SnapshotContentAdopted" for e in events_about(cluster, "default", "import-held"))

    wait_for("the adoption told", adopted, timeout=30)


def test_contents_that_are_not_this_nodes_are_left_alone(cluster: Cluster, agent: CsiAgent) -> None:
    sid = asyncio.run(agent.snapshot("elsewhere"))
    cluster.api.create(content("import-labelled", sid, labels={LABEL: OTHER}))  # someone else's already
    cluster.api.create(content("import-other-driver", sid, driver="hostpath.csi.k8s.io"))
    cluster.api.create(content("import-adopted-later", sid))  # the marker: adopted means the others were seen
    wait_for("the agent at work", lambda: owner(cluster, "import-adopted-later") == NODE, timeout=60)
    assert owner(cluster, "import-labelled") == OTHER
    assert owner(cluster, "import-other-driver") == ""


def test_a_content_no_node_holds_gets_one_event(cluster: Cluster, agent: CsiAgent) -> None:
    # Which agent speaks is the content's name's pick among the nodes running the driver: find a name this node's
    # agent speaks for, and one the other node's would (its agent does not run here, so nothing is said).
    from csi.snapshotimport import reporter

    names = [f"import-nowhere-{i}" for i in range(40)]
    ours = next(n for n in names if reporter(n, {NODE, OTHER}) == NODE)
    theirs = next(n for n in names if reporter(n, {NODE, OTHER}) == OTHER)
    missing = "snap-" + "0" * 32
    cluster.api.create(content(ours, missing))
    cluster.api.create(content(theirs, missing))

    def told(kind: str) -> list[dict[str, Any]]:
        return [e for e in events_about(cluster, "default", ours)
                if e["reason"] == "SnapshotNotFound" and e["regarding"]["kind"] == kind]  # fmt: skip

    wait_for("SnapshotNotFound on the content", lambda: bool(told("VolumeSnapshotContent")), timeout=90)
    (ev,) = told("VolumeSnapshotContent")
    assert ev["type"] == "Warning" and missing in ev["note"] and "none of the 2 nodes" in ev["note"], ev
    wait_for("SnapshotNotFound on the VolumeSnapshot", lambda: bool(told("VolumeSnapshot")), timeout=30)
    assert owner(cluster, ours) == ""
    assert not events_about(cluster, "default", theirs)  # the other node's agent would say it, not this one


@pytest.mark.parametrize(
    "case",
    ["another-node", "other-driver", "spec-too", "give-away", "no-handle"],
)
def test_the_policy_keeps_each_agent_to_its_own_node(cluster: Cluster, agent: CsiAgent, case: str) -> None:
    sid = asyncio.run(agent.snapshot(f"policy-{case}"))
    name = f"policy-{case}"
    admin = cluster.api
    if case == "give-away":
        admin.create(content(name, sid, labels={LABEL: NODE}))
    elif case == "other-driver":
        admin.create(content(name, sid, driver="hostpath.csi.k8s.io"))
    elif case == "no-handle":
        doc = content(name, sid)
        doc["spec"]["source"] = {"volumeHandle": "vol-x"}
        admin.create(doc)
    else:
        admin.create(content(name, "snap-" + "1" * 32))  # a handle the agent does not hold: it leaves it alone
    patch: dict[str, Any] = {"metadata": {"labels": {LABEL: NODE}}}
    if case == "another-node":
        patch = {"metadata": {"labels": {LABEL: OTHER}}}
    elif case == "spec-too":
        patch["spec"] = {"deletionPolicy": "Delete"}
    elif case == "give-away":
        patch = {"metadata": {"labels": {LABEL: OTHER}}}
    as_agent = cluster.cp.client(token=cluster.token)
    status, doc = as_agent.request("PATCH", f"{CONTENTS}/{name}", patch, "application/merge-patch+json")
    assert status == 403, (status, doc)
    assert "snapshot content" in doc["message"], doc
    if case in ("another-node", "spec-too"):  # the same change with only this node's label is the allowed adoption
        ok, _ = as_agent.request("PATCH", f"{CONTENTS}/{name}", {"metadata": {"labels": {LABEL: NODE}}},
                                 "application/merge-patch+json")  # fmt: skip
        assert ok == 200
