"""The agent's Kubernetes Events against a real kube-apiserver (scripts/lab/dralab.py: the agent on a temporary root
with a fake /dev, a token of its service account bound to its Node, the RBAC and admission policies of
daemonset/): a device that goes and comes back is told on the Node, a claim that cannot be prepared on the
ResourceClaim, a recurring one is one Event, and no agent can speak for another node."""

from __future__ import annotations

import asyncio
import datetime
import json
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import yaml

from nodeplug.api.dra.v1beta1 import api_pb2 as v1beta1
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

from lab.controlplane import ADMIN_TOKEN, CP_ADDR, missing_assets
from lab.dralab import NODE, NS, Agent, Cluster, make_claim, running_agent, running_cluster
from support.host import REPO
from support.wait import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_cluster("npev") as c:
        for doc in yaml.safe_load_all((REPO / "daemonset/rbac.yaml").read_text()):
            if doc and doc["metadata"]["name"].startswith("nodeplug-events"):
                c.api.create(doc)
        yield c


@pytest.fixture
def agent(cluster: Cluster) -> Iterator[Agent]:
    with running_agent(cluster) as a:
        yield a


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


def recorder_run(cluster: Cluster, steps: Any) -> Any:
    """Run ``steps(recorder, registry, listed, clock)`` (a coroutine function) with an EventRecorder of NODE's agent
    (the agent's own token) whose wall clock the test moves on (``clock[0]``); ``listed(namespace, name)`` lists the
    Events about an object as an administrator sees them. All on one loop in the control plane's namespace, where
    the API server is (the lab's own client is served by that namespace's one thread)."""
    from lightkube.resources.events_v1 import Event
    from prometheus_client import CollectorRegistry

    from nodeplug.kube import KubeClient, resolve
    from nodeplug.kube.events import EventRecorder

    admin_config = cluster.work / "admin-kubeconfig"
    admin_config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": f"https://{CP_ADDR}:6443",
                                               "certificate-authority": str(cluster.cp.ca())}}],
        "users": [{"name": "u", "user": {"token": ADMIN_TOKEN}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    agent_source, admin_source = resolve(cluster.kubeconfig, env={}), resolve(admin_config, env={})
    assert agent_source is not None and admin_source is not None
    clock = [datetime.datetime.now(datetime.UTC).timestamp()]

    async def go() -> Any:
        kube, admin, registry = KubeClient(agent_source), KubeClient(admin_source), CollectorRegistry()
        recorder = EventRecorder(kube, NODE, registry=registry, clock=lambda: clock[0])

        async def listed(namespace: str, name: str) -> list[Any]:
            return await admin.list(Event, namespace=namespace, fields={"regarding.name": name})

        await recorder.start()
        try:
            return await steps(recorder, registry, listed, clock)
        finally:
            await recorder.stop()
            await kube.close()
            await admin.close()

    return cluster.ns.call(asyncio.run, go())


async def until(what: str, probe: Any, timeout: float = 30) -> None:
    """Wait for the coroutine function ``probe`` to answer true (the timeout only bounds a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await probe():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.1)


def test_a_burst_about_one_object_is_cut_at_the_limit_and_the_rest_counted(cluster: Cluster) -> None:
    """30 different events about one object at once: the first 25 (the burst) become Events, the other 5 are
    dropped and counted; another object is not held back by the first one's burst."""
    from nodeplug.kube.events import BURST, Regarding

    tag = uuid.uuid4().hex[:6]
    node = Regarding.node(NODE)
    claim = Regarding("ResourceClaim", f"burst-{tag}", NS, str(uuid.uuid4()), "resource.k8s.io/v1beta1")

    async def steps(recorder: Any, registry: Any, listed: Any, clock: list[float]) -> tuple[list[int], float]:
        async def ours(namespace: str, name: str) -> list[Any]:
            return [e for e in await listed(namespace, name) if e.reason.startswith(f"Burst{tag}")]

        for i in range(BURST + 5):
            recorder.emit(node, "Normal", f"Burst{tag}N{i}", "one of a burst")
        recorder.emit(claim, "Warning", f"Burst{tag}Other", "another object")

        async def burst_written() -> bool:
            return len(await ours("default", NODE)) >= BURST

        async def other_written() -> bool:
            return len(await ours(NS, claim.name)) == 1

        await until("the burst's Events written", burst_written)
        await until("the other object's Event written", other_written)
        numbers = sorted(int(e.reason.rsplit("N", 1)[1]) for e in await ours("default", NODE))
        return numbers, float(registry.get_sample_value("nodeplug_events_dropped_total", {"cause": "rate limit"}))

    numbers, dropped = recorder_run(cluster, steps)
    assert numbers == list(range(BURST)) and dropped == 5


def test_a_recurring_event_is_one_event_whose_series_counts_every_occurrence(cluster: Cluster) -> None:
    """The same event ten times is one Event object; once the series' patch interval has passed on the recorder's
    clock, the next occurrence patches its series.count to eleven."""
    from nodeplug.kube.events import SERIES_PATCH_EVERY, Regarding

    tag = uuid.uuid4().hex[:6]
    node = Regarding.node(NODE)

    async def steps(recorder: Any, registry: Any, listed: Any, clock: list[float]) -> list[Any]:
        async def ours() -> list[Any]:
            return [e for e in await listed("default", NODE) if e.reason == f"Again{tag}"]

        async def written() -> bool:
            return len(await ours()) == 1

        async def counted() -> bool:
            got = await ours()
            return bool(got) and got[0].series is not None and got[0].series.count == 11

        recorder.emit(node, "Warning", f"Again{tag}", "the same thing again")
        await until("the first Event written", written)
        for _ in range(9):
            recorder.emit(node, "Warning", f"Again{tag}", "the same thing again")
        clock[0] += SERIES_PATCH_EVERY + 1
        recorder.emit(node, "Warning", f"Again{tag}", "the same thing again")
        await until("its series counted", counted)
        return await ours()

    (ev,) = recorder_run(cluster, steps)
    assert ev.series.count == 11 and ev.note == "the same thing again" and ev.type == "Warning"


def test_volume_data_no_record_names_is_told_on_the_node_at_start(cluster: Cluster, agent: Agent) -> None:
    """The CSI driver's reconcile at start finds a volume file that no record names (an interrupted create, or put
    there by hand): it leaves it in place and says so on the Node."""
    stray = agent.root / "var/lib/nodeplug/csi/volumes/vol-stray-data.img"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"\0" * 4096)
    agent.write_config(csi=True)
    agent.start()

    def told() -> list[dict[str, Any]]:
        return [e for e in events(cluster, "default", NODE) if e["reason"] == "VolumeDataUnrecorded"]

    wait_for("VolumeDataUnrecorded on the Node", lambda: any("vol-stray-data.img" in e["note"] for e in told()),
             timeout=30)  # fmt: skip
    (ev,) = [e for e in told() if "vol-stray-data.img" in e["note"]]
    assert ev["type"] == "Warning" and "left in place" in ev["note"] and ev["action"] == "Reconcile"
    assert stray.read_bytes() == b"\0" * 4096  # never deleted
