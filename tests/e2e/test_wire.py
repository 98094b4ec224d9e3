"""The wire contracts as kubelet, the CSI sidecars and a runtime see them: every method path of every service the
agent serves, called by its literal path over the agent's real unix sockets.

A wrong proto package, service or method name would make a call here fail with UNIMPLEMENTED (or never arrive at
the kubelet stand-in), so this test fails instead of a kubelet.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

if TYPE_CHECKING:
    from conftest import AgentProcess  # the fixture's type (tests/conftest.py)
from google.protobuf import symbol_database
from google.protobuf.descriptor import ServiceDescriptor
from grpc import aio

from nodeplug.api.csi.v1 import csi_pb2
from nodeplug.api.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from nodeplug.api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodeplug.api.pluginregistration.v1 import api_pb2 as reg_pb2

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent's plugins create loop devices and bridges"),
]

# Methods the agent deliberately does not implement, as the contracts allow (no capability advertised for them).
NOT_SERVED = {
    "/csi.v1.Controller/ControllerPublishVolume",
    "/csi.v1.Controller/ControllerUnpublishVolume",
    "/csi.v1.Controller/ControllerModifyVolume",
    "/csi.v1.SnapshotMetadata/GetMetadataAllocated",
    "/csi.v1.SnapshotMetadata/GetMetadataDelta",
}


class _Recorder(aio.ServerInterceptor):
    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        self.methods.append(details.method)
        return await continuation(details)


class _Kubelet(dp_grpc.RegistrationServicer):
    def __init__(self) -> None:
        self.requests: list[dp_pb2.RegisterRequest] = []

    async def Register(self, request: dp_pb2.RegisterRequest, context: Any) -> dp_pb2.Empty:
        self.requests.append(request)
        return dp_pb2.Empty()


def _methods(service: ServiceDescriptor) -> list[tuple[str, Any, Any, bool]]:
    db = symbol_database.Default()
    out = []
    for m in service.methods:
        req = db.GetSymbol(m.input_type.full_name)
        resp = db.GetSymbol(m.output_type.full_name)
        out.append((f"/{service.full_name}/{m.name}", req, resp, m.server_streaming))
    return out


async def _call(channel: aio.Channel, path: str, req: Any, resp: Any, streaming: bool) -> grpc.StatusCode:
    try:
        if streaming:
            call = channel.unary_stream(path, req.SerializeToString, resp.FromString)(req(), timeout=10)
            async for _ in call:
                call.cancel()
                break
            return grpc.StatusCode.OK
        await channel.unary_unary(path, req.SerializeToString, resp.FromString)(req(), timeout=30)
        return grpc.StatusCode.OK
    except aio.AioRpcError as e:
        return e.code()


@pytest.fixture
async def wired(spawn_agent: Callable[..., AgentProcess]) -> AsyncIterator[tuple[Path, _Kubelet, _Recorder]]:
    root = Path(tempfile.mkdtemp(prefix="npw-", dir="/tmp"))
    dp_dir = root / "var/lib/kubelet/device-plugins"
    dp_dir.mkdir(parents=True)
    recorder, kubelet = _Recorder(), _Kubelet()
    server = aio.server(interceptors=[recorder])
    dp_grpc.add_RegistrationServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{dp_dir / 'kubelet.sock'}")
    await server.start()
    agent = await asyncio.to_thread(spawn_agent, root)
    proc, log = agent.proc, agent.log
    sockets = [
        root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock",
        root / "var/lib/kubelet/plugins_registry/local.csi.nodeplug.io-reg.sock",
        root / "run/nodeplug/cni.sock",
    ]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (kubelet.requests and all(p.is_socket() for p in sockets)):
            assert proc.poll() is None, log.read_text()
            await asyncio.sleep(0.05)
        assert kubelet.requests, f"no registration within 30s:\n{log.read_text()}"
        assert all(p.is_socket() for p in sockets), log.read_text()
        yield root, kubelet, recorder
    finally:
        try:
            assert await asyncio.to_thread(agent.stop) == 0, log.read_text()
        finally:
            await server.stop(0)  # the spawn_agent fixture kills a stuck agent and removes the root


async def test_every_method_path_is_served(wired: tuple[Path, _Kubelet, _Recorder]) -> None:
    root, kubelet, recorder = wired
    assert recorder.methods[0] == "/v1beta1.Registration/Register"
    first = kubelet.requests[0]
    assert first.version == "v1beta1"
    assert first.resource_name.startswith("nodeplug.io/")
    dp_socket = root / "var/lib/kubelet/device-plugins" / first.endpoint
    assert dp_socket.is_socket(), first.endpoint

    csi_socket = root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock"
    reg_socket = root / "var/lib/kubelet/plugins_registry/local.csi.nodeplug.io-reg.sock"
    targets = [
        (dp_socket, dp_pb2.DESCRIPTOR.services_by_name["DevicePlugin"]),
        (reg_socket, reg_pb2.DESCRIPTOR.services_by_name["Registration"]),
        *[(csi_socket, s) for s in csi_pb2.DESCRIPTOR.services_by_name.values()],
    ]
    seen: dict[str, grpc.StatusCode] = {}
    for sock, service in targets:
        async with aio.insecure_channel(f"unix://{sock}") as channel:
            for path, req, resp, streaming in _methods(service):
                seen[path] = await _call(channel, path, req, resp, streaming)

    expected = {
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        "/csi.v1.Identity/GetPluginInfo",
        "/csi.v1.Identity/GetPluginCapabilities",
        "/csi.v1.Identity/Probe",
        "/csi.v1.Controller/CreateVolume",
        "/csi.v1.Controller/DeleteVolume",
        "/csi.v1.Controller/ValidateVolumeCapabilities",
        "/csi.v1.Controller/ListVolumes",
        "/csi.v1.Controller/GetCapacity",
        "/csi.v1.Controller/ControllerGetCapabilities",
        "/csi.v1.Controller/CreateSnapshot",
        "/csi.v1.Controller/DeleteSnapshot",
        "/csi.v1.Controller/ListSnapshots",
        "/csi.v1.Controller/GetSnapshot",
        "/csi.v1.Controller/ControllerExpandVolume",
        "/csi.v1.Controller/ControllerGetVolume",
        "/csi.v1.GroupController/GroupControllerGetCapabilities",
        "/csi.v1.GroupController/CreateVolumeGroupSnapshot",
        "/csi.v1.GroupController/DeleteVolumeGroupSnapshot",
        "/csi.v1.GroupController/GetVolumeGroupSnapshot",
        "/csi.v1.Node/NodeStageVolume",
        "/csi.v1.Node/NodeUnstageVolume",
        "/csi.v1.Node/NodePublishVolume",
        "/csi.v1.Node/NodeUnpublishVolume",
        "/csi.v1.Node/NodeGetVolumeStats",
        "/csi.v1.Node/NodeExpandVolume",
        "/csi.v1.Node/NodeGetCapabilities",
        "/csi.v1.Node/NodeGetInfo",
    }
    assert expected <= set(seen), sorted(expected - set(seen))
    unimplemented = {p for p, code in seen.items() if code == grpc.StatusCode.UNIMPLEMENTED}
    assert unimplemented <= NOT_SERVED, sorted(unimplemented - NOT_SERVED)
    unreachable = {p: c for p, c in seen.items() if c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)}
    assert not unreachable, unreachable
    for path in expected:
        assert seen[path] != grpc.StatusCode.UNIMPLEMENTED, path
    # an empty request is a caller's mistake: the answer names it instead of succeeding or crashing
    assert seen["/csi.v1.Node/NodePublishVolume"] == grpc.StatusCode.INVALID_ARGUMENT
    assert seen["/csi.v1.Controller/CreateVolume"] == grpc.StatusCode.INVALID_ARGUMENT
    assert seen["/csi.v1.Identity/GetPluginInfo"] == grpc.StatusCode.OK
    assert seen["/v1beta1.DevicePlugin/ListAndWatch"] == grpc.StatusCode.OK
