"""The wire contracts as kubelet, the CSI sidecars and a runtime see them: every method path of every service the
agent serves, called by its literal path over the agent's real unix sockets.

A wrong proto package, service or method name would make a call here fail with UNIMPLEMENTED (or never arrive at
the kubelet stand-in), so this test fails instead of a kubelet.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import symbol_database
from google.protobuf.descriptor import ServiceDescriptor
from grpc import aio

from nodeplug.api.csi.v1 import csi_pb2
from nodeplug.api.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from nodeplug.api.pluginregistration.v1 import api_pb2 as reg_pb2

from lab.kubelet import FakeKubelet
from support.agent import AgentProcess
from support.wait import eventually
from support.wire import MethodRecorder

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
async def wired(spawn_agent: Callable[..., AgentProcess]) -> AsyncIterator[tuple[Path, FakeKubelet, MethodRecorder]]:
    root = Path(tempfile.mkdtemp(prefix="npw-", dir="/tmp"))
    recorder = MethodRecorder()
    kubelet = FakeKubelet(root / "var/lib/kubelet/device-plugins", interceptors=[recorder])
    await kubelet.start()
    agent = await asyncio.to_thread(spawn_agent, root)
    proc, log = agent.proc, agent.log
    sockets = [
        root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock",
        root / "var/lib/kubelet/plugins_registry/local.csi.nodeplug.io-reg.sock",
        root / "run/nodeplug/cni.sock",
    ]
    try:
        await kubelet.changes.until(lambda: bool(kubelet.requests), 30, lambda: f"no registration:\n{log.read_text()}")
        await eventually(lambda: all(p.is_socket() for p in sockets) or proc.poll() is not None, 30, "every socket")
        assert all(p.is_socket() for p in sockets), log.read_text()
        yield root, kubelet, recorder
    finally:
        try:
            assert await asyncio.to_thread(agent.stop) == 0, log.read_text()
        finally:
            await kubelet.stop()  # the spawn_agent fixture kills a stuck agent and removes the root


async def test_every_method_path_is_served(wired: tuple[Path, FakeKubelet, MethodRecorder]) -> None:
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
