"""The agent's small HTTP endpoint: ``/healthz``, ``/readyz`` and ``/metrics``.

A few lines of asyncio instead of a web framework: three read-only GET routes, one request per connection, bodies
of a few kilobytes. ``/healthz`` answers 200 while the event loop runs; ``/readyz`` answers 200 only when every
enabled plugin reports ready (and lists each plugin either way); ``/metrics`` is the Prometheus text format.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nodeplug.log import get_logger
from nodeplug.metrics import Metrics
from nodeplug.plugin import Readiness

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 503: "Service Unavailable"}
_PROM_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_HEADER = 16 << 10

log = get_logger("http")


class HealthServer:
    def __init__(self, host: str, port: int, metrics: Metrics, readiness: Callable[[], dict[str, Readiness]]) -> None:
        self.host = host
        self.port = port
        self.metrics = metrics
        self.readiness = readiness
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        sock = self._server.sockets[0].getsockname()
        self.port = int(sock[1])
        log.info("serving health and metrics", address=f"{self.host}:{self.port}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def route(self, method: str, path: str) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            states = self.readiness()
            ready = all(r.ready for r in states.values())
            lines = [
                f"{name}: {'ready' if r.ready else 'not ready'}{' (' + r.detail + ')' if r.detail else ''}"
                for name, r in states.items()
            ]
            body = ("\n".join(lines) + "\n") if lines else "no plugins enabled\n"
            return (200 if ready else 503), "text/plain", body.encode()
        if path == "/metrics":
            return 200, _PROM_TYPE, self.metrics.render()
        return 404, "text/plain", b"not found: try /healthz, /readyz or /metrics\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        try:
            if len(head) > _MAX_HEADER:
                raise ValueError("header too large")
            method, path, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            status, ctype, body = self.route(method, path)
        except ValueError:
            method, (status, ctype, body) = "GET", (400, "text/plain", b"bad request\n")
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(header + (b"" if method == "HEAD" else body))
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
