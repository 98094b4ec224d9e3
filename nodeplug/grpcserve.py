"""Serving gRPC (grpc.aio) on a unix socket, with one interceptor that logs and measures every RPC.

Used by every plugin::

    server = UnixGrpcServer(path, plugin="csi", metrics=ctx.metrics)
    server.add(csi_pb2_grpc.add_IdentityServicer_to_server, IdentityServicer(...))
    await server.start()        # stale socket removed, socket created 0600
    ...
    await server.stop(grace)    # in-flight RPCs get ``grace`` seconds, socket removed

The interceptor records ``nodeplug_rpc_total`` / ``nodeplug_rpc_duration_seconds`` with the final status code and logs
one line per call (method, code, duration and the ids in the request: volume, snapshot, node). Methods listed in
``quiet`` (Probe, GetInfo, ...) log at debug. Requests are never logged whole, so CSI secrets never reach the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc import aio

from nodeplug.log import Logger, get_logger
from nodeplug.metrics import Metrics

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_ID_FIELDS = ("volume_id", "snapshot_id", "source_volume_id", "group_snapshot_id", "node_id", "name")
_SUN_PATH_MAX = 107
DEFAULT_QUIET = frozenset({"Probe", "GetPluginInfo", "GetPluginCapabilities", "GetInfo", "NodeGetCapabilities"})


def _ids(request: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in _ID_FIELDS:
        try:
            v = getattr(request, f)
        except AttributeError:
            continue
        if isinstance(v, str) and v:
            out[f] = v
    return out


def _code_name(context: Any, default: str) -> str:
    """The status the handler set (abort or set_code); ``default`` when it set none."""
    code = context.code()
    return str(code.name) if isinstance(code, grpc.StatusCode) else default


class _Observer(aio.ServerInterceptor):
    def __init__(self, plugin: str, metrics: Metrics, log: Logger, quiet: frozenset[str]) -> None:
        self.plugin = plugin
        self.metrics = metrics
        self.log = log
        self.quiet = quiet

    def _finish(self, method: str, code: str, start: float, ids: dict[str, str], error: str = "") -> None:
        seconds = time.perf_counter() - start
        self.metrics.observe_rpc(self.plugin, method, code, seconds)
        short = method.rsplit("/", 1)[-1]
        emit = self.log.debug if (short in self.quiet and code == "OK") else self.log.info
        if code not in ("OK", "CANCELLED", "ALREADY_EXISTS", "NOT_FOUND", "ABORTED") and error:
            emit = self.log.warning
        emit("rpc", rpc=method, code=code, ms=f"{seconds * 1000:.2f}", **ids, error=error or None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(details)
        if handler is None:
            return handler
        method: str = details.method
        # grpc's types describe the synchronous server's handlers; under grpc.aio they are coroutine functions
        # (unary) and async generators or coroutine functions (streams), so they are called as Any here
        if handler.unary_unary is not None:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                start, ids = time.perf_counter(), _ids(request)
                try:
                    resp = await inner_uu(request, context)
                except aio.AbortError:
                    self._finish(method, _code_name(context, "UNKNOWN"), start, ids, _details(context))
                    raise
                except Exception as e:
                    self.log.error("unhandled error in rpc", exc_info=True, rpc=method, **ids)
                    self._finish(method, "UNKNOWN", start, ids, repr(e))
                    raise
                self._finish(method, _code_name(context, "OK"), start, ids, _details(context))
                return resp

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                start, ids = time.perf_counter(), _ids(request)
                code = "OK"
                try:
                    result = inner_us(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:
                        await result
                    code = _code_name(context, "OK")
                except aio.AbortError:
                    code = _code_name(context, "UNKNOWN")
                    raise
                except (asyncio.CancelledError, GeneratorExit):  # the caller went away
                    code = "CANCELLED"
                    raise
                except Exception:
                    code = "UNKNOWN"
                    self.log.error("unhandled error in stream", exc_info=True, rpc=method, **ids)
                    raise
                finally:
                    self._finish(method, code, start, ids, _details(context))

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


def _details(context: Any) -> str:
    with contextlib.suppress(Exception):
        d = context.details()
        if isinstance(d, bytes):
            return d.decode(errors="replace")
        return str(d) if d else ""
    return ""


def remove_stale_socket(path: Path) -> None:
    """Remove a leftover socket (or dangling file) at ``path``; refuse to remove a directory."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"cannot listen on {path}: a directory is in the way")
    path.unlink()


class UnixGrpcServer:
    """One grpc.aio server listening on one unix socket."""

    def __init__(
        self,
        path: Path,
        plugin: str,
        metrics: Metrics,
        log: Logger | None = None,
        quiet: Iterable[str] = DEFAULT_QUIET,
        max_workers: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.plugin = plugin
        self.log = log or get_logger(plugin)
        self._server = aio.server(
            interceptors=[_Observer(plugin, metrics, self.log, frozenset(quiet))],
            options=[("grpc.so_reuseport", 0)],
        )
        self._started = False

    def add(self, add_fn: Callable[[Any, Any], None], servicer: Any) -> None:
        add_fn(servicer, self._server)

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(self.path)
        address = str(self.path)
        dir_fd = -1
        if len(address.encode()) > _SUN_PATH_MAX:
            # sockaddr_un holds 107 bytes: reach a deep directory through its /proc/self/fd link (bind happens
            # inside add_insecure_port, so the descriptor is only needed until it returns)
            dir_fd = os.open(self.path.parent, os.O_PATH | os.O_DIRECTORY)
            address = f"/proc/self/fd/{dir_fd}/{self.path.name}"
        old = os.umask(0o177)  # the socket file is created 0600 by bind()
        try:
            bound = self._server.add_insecure_port(f"unix://{address}")
        finally:
            os.umask(old)
            if dir_fd >= 0:
                os.close(dir_fd)
        if not bound:
            raise OSError(f"could not listen on unix socket {self.path}")
        await self._server.start()
        os.chmod(self.path, 0o600)
        self._started = True
        self.log.info("serving", socket=str(self.path))

    async def stop(self, grace: float) -> None:
        if self._started:
            await self._server.stop(grace)
            self._started = False
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    @property
    def serving(self) -> bool:
        return self._started and self.path.exists()

    async def wait(self) -> None:
        await self._server.wait_for_termination()
