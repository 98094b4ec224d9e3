"""The DRA driver against a real kube-apiserver (with DynamicResourceAllocation and resource.k8s.io/v1beta1) and
etcd, in a network namespace of its own; the whole agent runs there too, on a temporary root with a fake /dev of real
device nodes. kubelet's part is played over the real unix sockets: the plugin-watcher registration, the DRA gRPC
service in both packages, and the device plugin's ListAndWatch. Slices, claims and their status are real API
objects."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeplug.api.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from nodeplug.api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodeplug.api.dra.v1 import api_pb2 as v1
from nodeplug.api.dra.v1 import api_pb2_grpc as v1_grpc
from nodeplug.api.dra.v1beta1 import api_pb2 as v1beta1
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from nodeplug.api.pluginregistration.v1 import api_pb2 as reg_pb2
from nodeplug.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc

from lab.controlplane import missing_assets
from lab.dralab import (
    DRIVER,
    NODE,
    NS,
    SLICES,
    Agent,
    Cluster,
    make_claim,
    running_agent,
    running_cluster,
    start_apiserver,
)
from support.wait import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok")]

HANG = 60  # bounds a hang; the real waits are a fraction of a second


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_cluster("npdra") as c:
        yield c


@pytest.fixture
def agent(cluster: Cluster) -> Iterator[Agent]:
    try:
        with running_agent(cluster) as a:
            yield a
    finally:  # the agent is gone: what it published and the test's claims go too
        cluster.api.request("DELETE", SLICES)
        cluster.api.request("DELETE", f"/apis/resource.k8s.io/v1beta1/namespaces/{NS}/resourceclaims")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _dra(sock: Path, version: str, method: str, claims: list[tuple[str, str, str]]) -> Any:
    pb, stub_mod = (v1beta1, v1beta1_grpc) if version == "v1beta1" else (v1, v1_grpc)
    req_cls = pb.NodePrepareResourcesRequest if method == "prepare" else pb.NodeUnprepareResourcesRequest
    req = req_cls(claims=[pb.Claim(namespace=n, name=m, uid=u) for n, m, u in claims])
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        stub = stub_mod.DRAPluginStub(ch)
        call = stub.NodePrepareResources if method == "prepare" else stub.NodeUnprepareResources
        return await call(req, timeout=20)


async def _listing(sock: Path) -> dict[str, str]:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        stream = dp_grpc.DevicePluginStub(ch).ListAndWatch(dp_pb2.Empty(), timeout=10)
        first = await stream.read()
        stream.cancel()
    return {d.ID: d.health for d in first.devices}


def test_registration_as_kubelet_sees_it(cluster: Cluster, agent: Agent) -> None:
    agent.start()
    reg = agent.root / f"var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"

    async def go() -> Any:
        async with grpc.aio.insecure_channel(f"unix://{reg}") as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = await stub.GetInfo(reg_pb2.InfoRequest(), timeout=5)
            await stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
            return info

    info = run(go())
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert info.endpoint == f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock"  # the host's path, as kubelet dials it
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


def test_slices_follow_the_devices(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.mknod("npw1")
    agent.start()
    devs = wait_for("slice with two devices", lambda: len(cluster.devices()) == 2 and cluster.devices(), timeout=HANG)
    assert devs["widget-npw0"] == {"resource": "widget", "kind": "node", "path": "/dev/npw0"}
    (s,) = cluster.slices()
    assert s["spec"]["driver"] == DRIVER and s["spec"]["pool"]["name"] == NODE
    assert s["metadata"]["ownerReferences"][0]["uid"] == cluster.node_uid
    gen = s["spec"]["pool"]["generation"]

    agent.mknod("npw2")  # hotplug (how fast the slice follows is scripts/bench-dra's business)
    wait_for("hotplugged device in the slice", lambda: "widget-npw2" in cluster.devices(), timeout=HANG)
    assert cluster.slices()[0]["spec"]["pool"]["generation"] > gen

    (agent.host / "dev" / "npw0").unlink()
    wait_for("removed device gone from the slice", lambda: "widget-npw0" not in cluster.devices(), timeout=HANG)

    # kubelet deletes a node's slices when it starts: they come back
    cluster.api.ok("DELETE", SLICES)
    wait_for("slices published again", lambda: set(cluster.devices()) == {"widget-npw1", "widget-npw2"}, timeout=HANG)


def test_prepare_survives_a_restart_and_holds_the_device(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.mknod("npw1")
    agent.start()
    wait_for("slice", lambda: len(cluster.devices()) == 2, timeout=HANG)
    uid = make_claim(cluster, "c1", "widget-npw0")
    dp_sock = agent.root / "var/lib/kubelet/device-plugins/nodeplug-widget.sock"
    assert run(_listing(dp_sock)) == {"npw0": "Healthy", "npw1": "Healthy"}

    resp = run(_dra(agent.dra_socket, "v1beta1", "prepare", [(NS, "c1", uid), (NS, "nope", str(uuid.uuid4()))]))
    got = resp.claims[uid]
    assert got.error == ""
    assert [(d.pool_name, d.device_name, list(d.cdi_device_ids), list(d.request_names)) for d in got.devices] == [
        (NODE, "widget-npw0", [f"k8s.{DRIVER}/claim={uid}-widget-npw0"], ["w"])
    ]
    errors = {u: r.error for u, r in resp.claims.items() if u != uid}
    assert len(resp.claims) == 2 and "not found" in next(iter(errors.values()))
    assert agent.claim_specs() == [f"k8s.{DRIVER}-claim_{uid}.json"]
    spec = json.loads((agent.cdi_dir / agent.claim_specs()[0]).read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/npw0"
    # the device plugin no longer offers it, DRA stops nothing else
    assert run(_listing(dp_sock)) == {"npw0": "Unhealthy", "npw1": "Healthy"}
    # the same answer through the v1 service
    again = run(_dra(agent.dra_socket, "v1", "prepare", [(NS, "c1", uid)]))
    assert [d.device_name for d in again.claims[uid].devices] == ["widget-npw0"]

    agent.kill()  # kill -9 between prepare and unprepare
    agent.start()
    assert run(_listing(dp_sock)) == {"npw0": "Unhealthy", "npw1": "Healthy"}
    out = run(_dra(agent.dra_socket, "v1beta1", "unprepare", [(NS, "c1", uid)]))
    assert out.claims[uid].error == ""
    assert agent.claim_specs() == []
    wait_for("device offered again", lambda: run(_listing(dp_sock))["npw0"] == "Healthy", timeout=HANG)


def test_the_api_server_away(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.start()
    wait_for("slice", lambda: len(cluster.devices()) == 1, timeout=HANG)
    uid = make_claim(cluster, "c2", "widget-npw0")
    assert run(_dra(agent.dra_socket, "v1beta1", "prepare", [(NS, "c2", uid)])).claims[uid].error == ""
    uid3 = make_claim(cluster, "c3", "widget-npw0")
    dp_sock = agent.root / "var/lib/kubelet/device-plugins/nodeplug-widget.sock"
    cluster.cp.stop("apiserver")
    try:
        agent.mknod("npw1")
        wait_for("device plugin sees the hotplug", lambda: "npw1" in run(_listing(dp_sock)), timeout=HANG)
        again = run(_dra(agent.dra_socket, "v1beta1", "prepare", [(NS, "c2", uid), (NS, "c3", uid3)]))
        assert again.claims[uid].error == "" and again.claims[uid].devices[0].device_name == "widget-npw0"
        assert "cannot be read now" in again.claims[uid3].error
        assert run(_dra(agent.dra_socket, "v1beta1", "unprepare", [(NS, "c2", uid)])).claims[uid].error == ""
        assert agent.claim_specs() == []
    finally:
        cluster.api = start_apiserver(cluster.cp)
    wait_for("slices catch up", lambda: set(cluster.devices()) == {"widget-npw0", "widget-npw1"}, timeout=HANG)


def test_disabling_dra_removes_the_slices(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.start()
    wait_for("slice", lambda: len(cluster.devices()) == 1, timeout=HANG)
    agent.write_config(enabled=False, offer="deviceplugin")
    wait_for("slices removed", lambda: not cluster.slices(), timeout=HANG)
    assert not agent.dra_socket.exists()


def test_a_device_plugin_allocation_is_withheld_from_dra(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.mknod("npw1")
    agent.start()
    wait_for("slice", lambda: len(cluster.devices()) == 2, timeout=HANG)
    dp_sock = agent.root / "var/lib/kubelet/device-plugins/nodeplug-widget.sock"

    async def allocate() -> Any:
        async with grpc.aio.insecure_channel(f"unix://{dp_sock}") as ch:
            req = dp_pb2.AllocateRequest(container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=["npw1"])])
            return await dp_grpc.DevicePluginStub(ch).Allocate(req, timeout=10)

    run(allocate())
    wait_for("allocated device withheld from the slice", lambda: set(cluster.devices()) == {"widget-npw0"}, HANG)
    uid = make_claim(cluster, "c1", "widget-npw1")  # as from a slice read before the Allocate
    got = run(_dra(agent.dra_socket, "v1beta1", "prepare", [(NS, "c1", uid)])).claims[uid]
    assert "in use through the device plugin" in got.error and agent.claim_specs() == []


def test_the_agent_may_write_only_its_own_nodes_slices(cluster: Cluster, agent: Agent) -> None:
    agent.mknod("npw0")
    agent.start()  # under the service account of daemonset/, with a token bound to its node
    wait_for("slice", lambda: len(cluster.devices()) == 1, timeout=HANG)
    other = cluster.api.node("dra-other", [], ["192.168.77.251"])["metadata"]
    as_agent = cluster.cp.client(token=cluster.token)  # closed with the control plane
    spec = {"driver": DRIVER, "nodeName": "dra-other", "pool": {"name": "dra-other", "generation": 1,
            "resourceSliceCount": 1}, "devices": []}  # fmt: skip
    forged = {"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceSlice",
              "metadata": {"name": "forged"}, "spec": spec}  # fmt: skip
    # the API server applies a new ValidatingAdmissionPolicy once its informer has it: a dry run (which admission
    # judges all the same, storing nothing) until it is refused
    dry_run = "/apis/resource.k8s.io/v1beta1/resourceslices?dryRun=All"
    wait_for("the slice policy in force", lambda: as_agent.request("POST", dry_run, forged)[0] in (403, 422), HANG)
    try:
        status, doc = as_agent.request("POST", "/apis/resource.k8s.io/v1beta1/resourceslices", forged)
        assert status in (403, 422) and "may only write ResourceSlices of its own node" in json.dumps(doc), doc
        spec = {**spec, "driver": "gpu.example.com", "nodeName": NODE, "pool": {**spec["pool"], "name": NODE}}
        status, doc = as_agent.request("POST", "/apis/resource.k8s.io/v1beta1/resourceslices", {**forged, "spec": spec})
        assert status in (403, 422) and "driver devices.nodeplug.io" in json.dumps(doc), doc
        status, doc = as_agent.request("GET", f"/apis/resource.k8s.io/v1beta1/namespaces/{NS}/resourceclaims/x")
        assert status == 404  # claims are readable (this one does not exist)
    finally:
        cluster.api.request("DELETE", f"/api/v1/nodes/{other['name']}")


# what kubelet 1.32's plugin manager answers a plugin of a type it has no handler for (DynamicResourceAllocation off)
NO_HANDLER = (
    f"RegisterPlugin error -- no handler registered for plugin type: DRAPlugin at socket "
    f"/var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
)


async def _kubelet_answers(reg: Path, registered: bool, error: str = "") -> None:
    """What kubelet's plugin watcher does with a registration socket: GetInfo, then the outcome."""
    async with grpc.aio.insecure_channel(f"unix://{reg}") as ch:
        stub = reg_grpc.RegistrationStub(ch)
        await stub.GetInfo(reg_pb2.InfoRequest(), timeout=5)
        await stub.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=5
        )


def _readyz(agent: Agent, wanted: str) -> tuple[int, str]:
    """/readyz once its deviceplugin line says ``wanted``: (status, that line)."""
    seen: list[tuple[int, str]] = []

    def probe() -> tuple[int, str] | None:
        status, body = agent.http("/readyz")
        line = next((x for x in body.splitlines() if x.startswith("deviceplugin: ")), body)
        seen.append((status, line))
        return (status, line) if wanted in line else None

    try:
        return wait_for(f"/readyz saying {wanted!r}", probe, HANG)  # type: ignore[no-any-return]
    except AssertionError as e:
        raise AssertionError(f"{e}; last answer: {seen[-1:]}") from None


def test_auto_follows_what_kubelet_answers(cluster: Cluster, agent: Agent) -> None:
    """enabled: auto on an API server with resource.k8s.io: kubelet's registration decides. A kubelet without DRA
    keeps the pool empty (ready, "DRA off", said once in the log); one with DRA turns it on, with a shared device's
    replicas as devices of their own."""
    agent.mknod("npw0")
    agent.write_config(enabled="auto", offer="dra", replicas=3)
    agent.start()
    reg = agent.root / f"var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
    status, line = _readyz(agent, "DRA not decided yet: waiting for kubelet's plugin watcher")
    assert status == 200, line

    run(_kubelet_answers(reg, False, NO_HANDLER))
    status, body = _readyz(agent, "DRA off: this node's kubelet takes no DRA plugins")
    assert status == 200 and NO_HANDLER in body  # off is an answer, not a failure
    assert cluster.slices() == []
    log = agent.log.read_text()
    assert log.count("DRA off:") == 1 and "kubelet rejected" not in log

    run(_kubelet_answers(reg, True))  # kubelet restarted with DRA: the plugin watcher registers the driver again
    wait_for("the shared device's replicas in the slice",
             lambda: set(cluster.devices()) == {"widget-npw0-0", "widget-npw0-1", "widget-npw0-2"}, HANG)  # fmt: skip
    assert _readyz(agent, "DRA serving")[0] == 200

    run(_kubelet_answers(reg, False, NO_HANDLER))  # and without it again: the pool is emptied
    wait_for("the pool emptied", lambda: cluster.devices() == {}, HANG)
    assert agent.log.read_text().count("DRA off:") == 2


def test_auto_is_off_where_the_api_server_has_no_resource_api(cluster: Cluster, agent: Agent) -> None:
    """enabled: auto on an API server without resource.k8s.io (1.32's default: DynamicResourceAllocation off, no
    v1beta1): DRA off, whatever kubelet says; the device plugin serves the resource as before."""
    cluster.cp.stop("apiserver")
    try:
        cluster.api = cluster.cp.start_apiserver()  # the same etcd and credentials, DRA off
        agent.mknod("npw0")
        agent.write_config(enabled="auto")
        agent.start()
        run(_kubelet_answers(agent.root / f"var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock", True))
        _readyz(agent, "DRA off: the API server does not serve resource.k8s.io")
        dp_sock = agent.root / "var/lib/kubelet/device-plugins/nodeplug-widget.sock"
        assert run(_listing(dp_sock)) == {"npw0": "Healthy"}
        assert agent.log.read_text().count("DRA off:") == 1
    finally:
        cluster.cp.stop("apiserver")
        cluster.api = start_apiserver(cluster.cp)


def test_a_shared_device_is_shared_replica_by_replica(cluster: Cluster, agent: Agent) -> None:
    """replicas: 3, offered both ways: three devices in the slice; a replica the device plugin hands out leaves the
    slice, a replica a claim holds is unhealthy to the device plugin, and the device's third replica stays offered
    on both sides."""
    agent.write_config(offer="both", replicas=3)
    agent.mknod("npw0")
    agent.start()
    every = {"widget-npw0-0", "widget-npw0-1", "widget-npw0-2"}
    wait_for("the three replicas in the slice", lambda: set(cluster.devices()) == every, HANG)
    dp_sock = agent.root / "var/lib/kubelet/device-plugins/nodeplug-widget.sock"

    async def allocate(replica: str) -> Any:
        async with grpc.aio.insecure_channel(f"unix://{dp_sock}") as ch:
            req = dp_pb2.AllocateRequest(container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=[replica])])
            return await dp_grpc.DevicePluginStub(ch).Allocate(req, timeout=10)

    run(allocate("npw0::1"))
    wait_for("the allocated replica withheld", lambda: set(cluster.devices()) == every - {"widget-npw0-1"}, HANG)
    uid = make_claim(cluster, "c1", "widget-npw0-2")
    got = run(_dra(agent.dra_socket, "v1beta1", "prepare", [(NS, "c1", uid)])).claims[uid]
    assert got.error == "" and [d.device_name for d in got.devices] == ["widget-npw0-2"]
    assert run(_listing(dp_sock)) == {"npw0::0": "Healthy", "npw0::1": "Healthy", "npw0::2": "Unhealthy"}
    late = make_claim(cluster, "c2", "widget-npw0-1")  # from a slice read before the Allocate
    assert "in use through the device plugin" in run(_dra(agent.dra_socket, "v1beta1", "prepare",
                                                          [(NS, "c2", late)])).claims[late].error  # fmt: skip
    assert run(_dra(agent.dra_socket, "v1beta1", "unprepare", [(NS, "c1", uid)])).claims[uid].error == ""
    assert run(_listing(dp_sock))["npw0::2"] == "Healthy"
