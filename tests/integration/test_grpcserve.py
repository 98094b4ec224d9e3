"""UnixGrpcServer: socket handling, status codes in metrics, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.metrics import Metrics

from support.wait import eventually


def _identity(b: bytes) -> bytes:
    return b


class _Echo:
    """A generic service (no stubs needed) with one OK method and one that aborts."""

    @staticmethod
    def register(server: Any) -> None:
        async def echo(req: bytes, ctx: Any) -> bytes:
            return req

        async def fail(req: bytes, ctx: Any) -> bytes:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, "volume vol-x does not exist")
            return b""

        async def stream(req: bytes, ctx: Any) -> Any:
            for i in range(3):
                yield bytes([i])

        async def forever(req: bytes, ctx: Any) -> Any:
            yield b"first"
            await asyncio.Event().wait()  # like ListAndWatch: until the caller goes away

        handlers = {
            "Forever": grpc.unary_stream_rpc_method_handler(forever, _identity, _identity),
            "Echo": grpc.unary_unary_rpc_method_handler(echo, _identity, _identity),
            "Fail": grpc.unary_unary_rpc_method_handler(fail, _identity, _identity),
            "Stream": grpc.unary_stream_rpc_method_handler(stream, _identity, _identity),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))


def _sample(metrics: Metrics, method: str, code: str) -> float:
    v = metrics.registry.get_sample_value("nodeplug_rpc_total", {"plugin": "test", "method": method, "code": code})
    return v or 0.0


async def test_serves_on_a_private_socket_and_counts_codes(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "t.sock"
    path.parent.mkdir()
    path.write_text("stale")  # a leftover file from a crashed run
    metrics = Metrics()
    server = UnixGrpcServer(path, "test", metrics)
    server.add(lambda _servicer, s: _Echo.register(s), None)
    await server.start()
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        async with aio.insecure_channel(f"unix://{path}") as ch:
            assert await ch.unary_unary("/test.Echo/Echo")(b"hi") == b"hi"
            with pytest.raises(aio.AioRpcError) as exc:
                await ch.unary_unary("/test.Echo/Fail")(b"")
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            got = [m async for m in ch.unary_stream("/test.Echo/Stream")(b"")]
            assert got == [b"\x00", b"\x01", b"\x02"]
        assert _sample(metrics, "/test.Echo/Echo", "OK") == 1
        assert _sample(metrics, "/test.Echo/Fail", "NOT_FOUND") == 1
        assert _sample(metrics, "/test.Echo/Stream", "OK") == 1
        async with aio.insecure_channel(f"unix://{path}") as ch:
            call = ch.unary_stream("/test.Echo/Forever")(b"")
            assert await call.read() == b"first"
            call.cancel()
        # the server learns of the cancel asynchronously
        await eventually(lambda: _sample(metrics, "/test.Echo/Forever", "CANCELLED") == 1, what="the cancel counted")
        assert b"nodeplug_rpc_duration_seconds_bucket" in metrics.render()
    finally:
        await server.stop(1)
    assert not path.exists()


async def test_refuses_to_remove_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "in-the-way"
    path.mkdir()
    server = UnixGrpcServer(path, "test", Metrics())
    with pytest.raises(IsADirectoryError, match="a directory is in the way"):
        await server.start()
    assert path.is_dir()


async def test_listens_on_a_path_longer_than_sockaddr_un(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = deep / "long.sock"
    assert len(str(path)) > 107
    server = UnixGrpcServer(path, "test", Metrics())
    server.add(lambda _servicer, s: _Echo.register(s), None)
    await server.start()
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        fd = os.open(deep, os.O_PATH | os.O_DIRECTORY)
        try:
            async with aio.insecure_channel(f"unix:///proc/self/fd/{fd}/long.sock") as ch:
                assert await ch.unary_unary("/test.Echo/Echo")(b"deep") == b"deep"
        finally:
            os.close(fd)
    finally:
        await server.stop(1)
    assert not path.exists()


async def test_requests_are_logged_by_id_never_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A CSI request's secrets never reach the log: the interceptor logs the method, code and ids only."""
    from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

    class Controller(csi_pb2_grpc.ControllerServicer):
        async def CreateVolume(self, request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no space for volume pvc-1")

    path = tmp_path / "csi.sock"
    server = UnixGrpcServer(path, "csi", Metrics())
    server.add(csi_pb2_grpc.add_ControllerServicer_to_server, Controller())
    await server.start()
    caplog.set_level(logging.DEBUG, logger="nodeplug")
    try:
        async with aio.insecure_channel(f"unix://{path}") as ch:
            req = csi_pb2.CreateVolumeRequest(name="pvc-1", secrets={"password": "hunter2-secret"})
            with pytest.raises(aio.AioRpcError):
                await csi_pb2_grpc.ControllerStub(ch).CreateVolume(req)
    finally:
        await server.stop(1)
    rpc = [r for r in caplog.records if r.getMessage() == "rpc"]
    assert len(rpc) == 1
    fields = rpc[0].__dict__["fields"]
    assert fields["rpc"] == "/csi.v1.Controller/CreateVolume"
    assert fields["code"] == "RESOURCE_EXHAUSTED" and fields["name"] == "pvc-1"
    assert "hunter2" not in repr(caplog.records[0].__dict__) + caplog.text
    assert all("hunter2" not in repr(r.__dict__) for r in caplog.records)
