"""The agent's Kubernetes Events against a real kube-apiserver (scripts/lab/dralab.py: the agent on a temporary root
with a fake /dev, a token of its service account bound to its Node, the RBAC and admission policies of
daemonset/): a device that goes and comes back is told on the Node, a claim that cannot be prepared on the
ResourceClaim, a recurring one is one Event, and no agent can speak for another node."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from nodeplug.api.dra.v1beta1 import api_pb2 as v1beta1
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

from lab.controlplane import missing_assets
from lab.dralab import NODE, NS, Agent, Cluster, make_claim
from lab.netns import Netns
from support.host import REPO
from support.wait import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    work = Path(tempfile.mkdtemp(prefix="npev-", dir="/tmp"))
    ns = Netns("npev" + uuid.uuid4().hex[:6])
    c: Cluster | None = None
    try:
        c = Cluster(work, ns)
        for doc in yaml.safe_load_all((REPO / "daemonset/rbac.yaml").read_text()):
            if doc and doc["metadata"]["name"].startswith("nodeplug-events"):
                c.api.create(doc)
        yield c
    finally:
        if c is not None:
            c.cp.close()
        ns.delete()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def agent(cluster: Cluster) -> Iterator[Agent]:
    root = Path(tempfile.mkdtemp(prefix="npa-", dir="/tmp"))
    a = Agent(cluster, root)
    try:
        yield a
    finally:
        a.kill()
        shutil.rmtree(root, ignore_errors=True)


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    path = f"/apis/events.k8s.io/v1/namespaces/{namespace}/events?fieldSelector=regarding.name%3D{name}"
    return list(cluster.api.ok("GET", path)["items"])


def reasons(cluster: Cluster, namespace: str, name: str) -> list[str]:
    return [str(e["reason"]) for e in events(cluster, namespace, name)]


def test_a_device_that_goes_and_comes_back_is_told_on_the_node(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.start()
    (agent.host / "dev" / "npw0").unlink()
    wait_for("DeviceUnhealthy on the Node", lambda: "DeviceUnhealthy" in reasons(cluster, "default", NODE), timeout=30)
    (ev,) = [e for e in events(cluster, "default", NODE) if e["reason"] == "DeviceUnhealthy"]
    assert ev["type"] == "Warning" and "npw0" in ev["note"] and "gone" in ev["note"], ev
    assert ev["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert ev["reportingController"] == "nodeplug.io/agent" and ev["reportingInstance"] == f"nodeplug-{NODE}"
    agent.mknod("npw0")
    wait_for("DeviceHealthy on the Node", lambda: "DeviceHealthy" in reasons(cluster, "default", NODE), timeout=30)


def test_a_claim_that_cannot_be_prepared_says_why_on_the_claim_once(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw1")
    agent.start()
    uid = make_claim(cluster, "nowhere", "widget-npw9")  # no such device on this node

    async def prepare() -> str:
        req = v1beta1.NodePrepareResourcesRequest(claims=[v1beta1.Claim(namespace=NS, name="nowhere", uid=uid)])
        async with grpc.aio.insecure_channel(f"unix://{agent.dra_socket}") as ch:
            got = await v1beta1_grpc.DRAPluginStub(ch).NodePrepareResources(req, timeout=20)
        return str(got.claims[uid].error)

    wait_for("the driver reading claims", lambda: "no such device" in asyncio.run(prepare()), timeout=30)
    for _ in range(2):  # kubelet retries
        assert "no such device" in asyncio.run(prepare())
    wait_for("ClaimNotPrepared on the claim", lambda: "ClaimNotPrepared" in reasons(cluster, NS, "nowhere"), timeout=30)
    (ev,) = [e for e in events(cluster, NS, "nowhere") if "widget-npw9" in e["note"]]  # 3 failures, 1 Event
    assert ev["regarding"]["kind"] == "ResourceClaim" and ev["regarding"]["uid"] == uid
    assert "widget-npw9" in ev["note"] and ev["type"] == "Warning"


def test_an_agent_may_not_speak_for_another_node(cluster: Cluster) -> None:
    agent_api = cluster.cp.client(token=cluster.token)  # bound to NODE
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def event(instance: str) -> dict[str, Any]:
        return {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": f"x.{uuid.uuid4().hex}", "namespace": "default"}, "eventTime": now,
                "reportingController": "nodeplug.io/agent", "reportingInstance": instance, "action": "Route",
                "reason": "Test", "type": "Normal", "note": "n",
                "regarding": {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}}  # fmt: skip

    path = "/apis/events.k8s.io/v1/namespaces/default/events"
    assert agent_api.request("POST", path, event(f"nodeplug-{NODE}"))[0] == 201
    status, doc = agent_api.request("POST", path, event("nodeplug-some-other-node"))
    assert status == 403 and "reported by the agent of its own node" in doc["message"], doc
