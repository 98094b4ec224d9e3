"""The generated stubs: they match proto/ (scripts/gen-protos run afresh), and carry the upstream method paths over a
real unix socket."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.api.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from nodeplug.api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

from support.wire import MethodRecorder

TOP = Path(__file__).resolve().parents[2]
GEN = TOP / "scripts" / "gen-protos"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_stubs_match_protos(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(GEN), "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 0, f"scripts/gen-protos failed:\n{proc.stderr}"
    fresh = _tree(tmp_path / "nodeplug" / "api")
    committed = _tree(TOP / "nodeplug" / "api")
    assert fresh, "scripts/gen-protos produced nothing"
    drifted = sorted(
        [f"changed: {n}" for n in fresh.keys() & committed.keys() if fresh[n] != committed[n]]
        + [f"missing from the tree: {n}" for n in fresh.keys() - committed.keys()]
        + [f"not generated any more: {n}" for n in committed.keys() - fresh.keys()]
    )
    assert not drifted, "nodeplug/api drifted from proto/; run scripts/gen-protos:\n  " + "\n  ".join(drifted)


class _Identity(csi_pb2_grpc.IdentityServicer):
    async def GetPluginInfo(self, request: Any, context: Any) -> Any:
        return csi_pb2.GetPluginInfoResponse(name="local.csi.nodeplug.io", vendor_version="test")

    async def GetPluginCapabilities(self, request: Any, context: Any) -> Any:
        return csi_pb2.GetPluginCapabilitiesResponse()

    async def Probe(self, request: Any, context: Any) -> Any:
        return csi_pb2.ProbeResponse()


class _Registration(dp_grpc.RegistrationServicer):
    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def Register(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return dp_pb2.Empty()


async def test_real_unix_socket_round_trip(tmp_path: Path) -> None:
    sock = tmp_path / "api.sock"
    recorder = MethodRecorder()
    registration = _Registration()
    server = grpc.aio.server(interceptors=[recorder])
    csi_pb2_grpc.add_IdentityServicer_to_server(_Identity(), server)
    dp_grpc.add_RegistrationServicer_to_server(registration, server)
    assert server.add_insecure_port(f"unix://{sock}") != 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            info = await csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10)
            reply = await dp_grpc.RegistrationStub(channel).Register(
                dp_pb2.RegisterRequest(version="v1beta1", endpoint="foo.sock", resource_name="nodeplug.io/foo"),
                timeout=10,
            )
    finally:
        await server.stop(None)
    assert info.name == "local.csi.nodeplug.io"
    assert isinstance(reply, dp_pb2.Empty)
    assert [r.resource_name for r in registration.requests] == ["nodeplug.io/foo"]
    assert recorder.methods == ["/csi.v1.Identity/GetPluginInfo", "/v1beta1.Registration/Register"]
