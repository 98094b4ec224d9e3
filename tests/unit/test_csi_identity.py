"""Identity service and kubelet plugin registration over real unix sockets (no root needed)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from csi.identity import IdentityServicer
from nodeplug import __version__
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.api.pluginregistration.v1 import api_pb2, api_pb2_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.metrics import Metrics
from nodeplug.pluginwatcher import CSI_PLUGIN, RegistrationServer

Identity = tuple[csi_pb2_grpc.IdentityStub, "ProbeState"]


class ProbeState:
    def __init__(self) -> None:
        self.ready = False
        self.broken = ""

    async def __call__(self) -> bool:
        if self.broken:
            raise RuntimeError(self.broken)
        return self.ready


@pytest.fixture
async def identity(tmp_path: Path) -> AsyncIterator[Identity]:
    state = ProbeState()
    sock = tmp_path / "csi.sock"
    server = UnixGrpcServer(sock, "csi", Metrics())
    server.add(csi_pb2_grpc.add_IdentityServicer_to_server, IdentityServicer("local.csi.nodeplug.io", state))
    await server.start()
    try:
        async with aio.insecure_channel(f"unix://{sock}") as ch:
            yield csi_pb2_grpc.IdentityStub(ch), state
    finally:
        await server.stop(0)


async def test_plugin_info_names_driver_and_package_version(identity: Identity) -> None:
    stub, _ = identity
    info = await stub.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == "local.csi.nodeplug.io"
    assert info.vendor_version == __version__


async def test_capabilities(identity: Identity) -> None:
    stub, _ = identity
    resp = await stub.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    services = {c.service.type for c in resp.capabilities if c.HasField("service")}
    S = csi_pb2.PluginCapability.Service
    assert services == {S.CONTROLLER_SERVICE, S.VOLUME_ACCESSIBILITY_CONSTRAINTS, S.GROUP_CONTROLLER_SERVICE}
    expansion = [c.volume_expansion.type for c in resp.capabilities if c.HasField("volume_expansion")]
    assert expansion == [csi_pb2.PluginCapability.VolumeExpansion.ONLINE]


async def test_probe_not_ready_ready_and_unhealthy(identity: Identity) -> None:
    stub, state = identity
    resp = await stub.Probe(csi_pb2.ProbeRequest())
    assert resp.HasField("ready") and resp.ready.value is False
    state.ready = True
    assert (await stub.Probe(csi_pb2.ProbeRequest())).ready.value is True
    state.broken = "database disk image is malformed"
    with pytest.raises(aio.AioRpcError) as e:
        await stub.Probe(csi_pb2.ProbeRequest())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "malformed" in (e.value.details() or "")


async def test_registration_get_info_and_status(tmp_path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="npreg", dir="/tmp"))  # unix socket paths are limited to 107 bytes
    sock = short / "plugins_registry" / "local.csi.nodeplug.io-reg.sock"
    reg = RegistrationServer(
        socket_path=sock,
        plugin_type=CSI_PLUGIN,
        name="local.csi.nodeplug.io",
        endpoint="/var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock",
        supported_versions=["1.0.0"],
        metrics=Metrics(),
        plugin="csi",
    )
    await reg.start()
    try:
        assert reg.serving and sock.exists() and (sock.stat().st_mode & 0o777) == 0o600
        assert reg.status.registered is None and "not yet registered" in reg.status.describe()
        async with aio.insecure_channel(f"unix://{sock}") as ch:
            kubelet = api_pb2_grpc.RegistrationStub(ch)
            info = await kubelet.GetInfo(api_pb2.InfoRequest())
            assert (info.type, info.name) == ("CSIPlugin", "local.csi.nodeplug.io")
            assert info.endpoint == "/var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock"
            assert list(info.supported_versions) == ["1.0.0"]
            assert reg.status.info_calls == 1 and "asked for plugin info" in reg.status.describe()
            await kubelet.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=False, error="bad"))
            assert reg.rejected and "bad" in reg.status.describe()
            await kubelet.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=True))
            assert reg.status.registered is True and not reg.rejected
            assert reg.status.describe() == "registered with kubelet"
    finally:
        await reg.stop(0)
        gone = not sock.exists()
        shutil.rmtree(short)
    assert gone, "stop() must remove the registration socket"
