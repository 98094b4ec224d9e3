"""The DRA gRPC services over a real unix socket, as kubelet calls them: both packages, per-claim answers, requests
refused whole only when malformed; the claim source is a dict (pure logic behind the wire)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from lightkube.resources.resource_v1beta1 import ResourceClaim

from deviceplugin.config import Resource
from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.dra.claims import ClaimError
from deviceplugin.dra.prepare import Offered, Preparer
from deviceplugin.dra.servicer import MAX_CLAIMS, Handler, V1Beta1Servicer, V1Servicer
from deviceplugin.dra.store import ClaimStore
from deviceplugin.state import DeviceTable
from nodeplug.api.dra.v1 import api_pb2 as v1
from nodeplug.api.dra.v1 import api_pb2_grpc as v1_grpc
from nodeplug.api.dra.v1beta1 import api_pb2 as v1beta1
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.log import get_logger
from nodeplug.metrics import Metrics

DRIVER = "devices.nodeplug.io"
UID = "11111111-2222-4333-8444-555555555555"
RES = Resource(name="fuse", devices=["/dev/fuse"], offer="dra")


class Source:
    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        if name != "c1":
            raise ClaimError(f"ResourceClaim {namespace}/{name} not found")
        result = {"request": "r", "driver": DRIVER, "pool": "n1", "device": "fuse-fuse"}
        return ResourceClaim.from_dict({
            "metadata": {"namespace": namespace, "name": name, "uid": UID},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result]}}},
        })  # fmt: skip


class Devices:
    def offered(self, name: str) -> Offered | None:
        dev = Device("fuse", (DeviceNode("/dev/fuse", "/dev/fuse"),))
        return Offered(name, RES, dev) if name == "fuse-fuse" else None

    def in_use_elsewhere(self, resource: str, device_id: str) -> str:
        return ""

    def claims_changed(self) -> None:
        pass

    async def reset(self, resource: Resource, devices: Any) -> None:
        pass


@pytest.fixture
async def sock(tmp_path: Path) -> AsyncIterator[Path]:
    preparer = Preparer(
        driver=DRIVER, pool="n1", store=ClaimStore(tmp_path / "c.db"), source=Source(), devices=Devices(),
        cdi_dir=tmp_path / "cdi", log=get_logger("test"),
    )  # fmt: skip
    handler = Handler(preparer, get_logger("test"))
    server = UnixGrpcServer(tmp_path / "dra.sock", plugin="dra", metrics=Metrics())
    server.add(v1_grpc.add_DRAPluginServicer_to_server, V1Servicer(handler))
    server.add(v1beta1_grpc.add_DRAPluginServicer_to_server, V1Beta1Servicer(handler))
    await server.start()
    try:
        yield tmp_path / "dra.sock"
    finally:
        await server.stop(0)
        preparer.store.close()


@pytest.mark.parametrize("pb, stub", [(v1beta1, v1beta1_grpc.DRAPluginStub), (v1, v1_grpc.DRAPluginStub)])
async def test_per_claim_answers(sock: Path, pb: Any, stub: Any) -> None:
    claims = [
        pb.Claim(namespace="ns", name="c1", uid=UID),
        pb.Claim(namespace="ns", name="c1", uid=UID),  # twice in one request: one answer, prepared once
        pb.Claim(namespace="ns", name="gone", uid="21111111-2222-4333-8444-555555555555"),
        pb.Claim(namespace="NS/..", name="x", uid="not-a-uid"),
    ]
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        resp = await stub(ch).NodePrepareResources(pb.NodePrepareResourcesRequest(claims=claims), timeout=10)
        assert set(resp.claims) == {UID, "21111111-2222-4333-8444-555555555555", "not-a-uid"}
        ok = resp.claims[UID]
        assert ok.error == "" and [(d.pool_name, d.device_name) for d in ok.devices] == [("n1", "fuse-fuse")]
        assert list(ok.devices[0].cdi_device_ids) == [f"k8s.{DRIVER}/claim={UID}-fuse-fuse"]
        assert "not found" in resp.claims["21111111-2222-4333-8444-555555555555"].error
        assert "expected a namespace" in resp.claims["not-a-uid"].error
        assert [p.name for p in (sock.parent / "cdi").iterdir()] == [f"k8s.{DRIVER}-claim_{UID}.json"]
        out = await stub(ch).NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=claims[:1]), timeout=10)
        assert out.claims[UID].error == "" and list((sock.parent / "cdi").iterdir()) == []


async def test_a_malformed_request_is_refused_whole(sock: Path) -> None:
    claims = [v1.Claim(namespace="ns", name="c1", uid=UID)] * (MAX_CLAIMS + 1)
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1.NodePrepareResourcesRequest(claims=claims))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_held_devices_are_unhealthy_to_the_device_plugin_only() -> None:
    t = DeviceTable(replicas=2)
    t.update([Device("fuse", ())], now=0.0)
    assert t.set_held({"fuse": "prepared for DRA claim ns/c"})
    assert [(e.id, e.healthy, e.reason) for e in t.listing] == [
        ("fuse::0", False, "prepared for DRA claim ns/c"),
        ("fuse::1", False, "prepared for DRA claim ns/c"),
    ]
    assert t.reason("fuse") == ""  # its own health is untouched
    assert not t.set_held({"fuse": "prepared for DRA claim ns/c"})
    assert t.set_held({}) and all(e.healthy for e in t.listing)
