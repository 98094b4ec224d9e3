"""The agent's CNI plugin: serves thick mode on ``/run/nodeplug/cni.sock`` (under the agent's root).

An asyncio unix server speaks :mod:`cni.thick`: read the request, ACK, wait for GO, then run the very same protocol
code the standalone entry point runs (:func:`cni.skel.run` over :mod:`cni.commands` and :mod:`cni.dataplane`) in a
thread pool of ``workers`` threads, and send back the exit status and stdout. Requests for the same container id are
serialised (an ADD and the DEL that follows a failed sandbox never overlap); different containers run concurrently.
A request larger than ``max_request_bytes`` is answered with an error naming the limit (NAK), never run, and never
left to a silent fallback; a config naming another agent's socket gets NOT_HERE. The socket file is created with mode
0600 by ``bind`` itself (the mode is set on the socket before it has a name), so it is never connectable by others,
whatever the umask.

Warm state is the point: the dataplane is imported and the SQLite stores stay open between requests (``cni.ipam.sqlite``
caches them), so a thick-mode ADD costs the netlink work and one transaction, not a Python start-up.

Metrics: ``nodeplug_cni_requests_total{command,code}`` and ``nodeplug_cni_request_duration_seconds{command}``.

The cluster pod network is a plugin of its own (:mod:`cni.cluster`): it hands this server nothing but the node's
pod subnets, in a file the IPAM reads on each ADD (:mod:`cni.nodesubnets`). Network policy (:mod:`cni.policy`) is
told of each pod's addresses through :attr:`nodeplug.plugin.AgentContext.pod_addresses` before ADD answers and
before DEL frees them; while it does not run here, addresses are quarantined (:class:`cni.commands.Quarantine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Histogram

from cni import thick
from cni.config import Config
from cni.errors import INVALID_NETWORK_CONFIG, CniError
from cni.skel import Handler
from nodeplug.grpcserve import remove_stale_socket
from nodeplug.keyedlocks import KeyedLocks
from nodeplug.metrics import RPC_BUCKETS
from nodeplug.plugin import AgentContext, Readiness


class CniPlugin:
    name = "cni"

    def __init__(self, section: Config, ctx: AgentContext, *, handlers: Mapping[str, Handler] | None = None) -> None:
        """``handlers``: the command table the server runs (default: :func:`cni.commands.table` over the dataplane,
        imported at start), the same kind of table the entry point's :func:`cni.entry.run` takes: commands over a
        dataplane or a store of one's own."""
        self.section = section
        self._handlers = handlers
        self.ctx = ctx
        self.log = ctx.logger("cni")
        self.path = Path(ctx.root(section.socket))
        self._server: asyncio.AbstractServer | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._table: Mapping[str, Handler] = {}
        self._locks = KeyedLocks()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.requests = Counter(
            "nodeplug_cni_requests",
            "CNI invocations served in thick mode, by command and CNI result code (0 for success).",
            ["command", "code"],
            registry=ctx.metrics.registry,
        )
        self.seconds = Histogram(
            "nodeplug_cni_request_duration_seconds",
            "Thick-mode CNI invocation latency in seconds (from GO to answer), by command.",
            ["command"],
            buckets=RPC_BUCKETS,
            registry=ctx.metrics.registry,
        )

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from cni import commands

        if self._handlers is not None:
            self._table = self._handlers
        else:
            # warm: the dataplane is imported once, here; in a thread, as that takes
            # tens of milliseconds during which the loop would stop serving the HTTP endpoint and the other plugins
            dataplane = await asyncio.to_thread(importlib.import_module, "cni.dataplane")
            self._table = commands.table(dataplane, addresses=_AgentAddresses(self.ctx))
        self._executor = ThreadPoolExecutor(self.section.workers, thread_name_prefix="cni")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(self.path)  # from a previous run: nobody can be serving it (we are the agent)
        self._server = await asyncio.start_unix_server(self._accept, sock=_listening_socket(self.path))
        self.log.info("serving CNI thick mode", socket=str(self.path), workers=self.section.workers)

    async def stop(self, grace: float) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for t in pending:
                t.cancel()
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=max(grace, 0.1))
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        from cni.ipam import sqlite

        # close_all takes each store's lock, which a worker still finishing a transaction (the pool is not waited
        # for) may hold for up to the busy timeout: not on the event loop
        await asyncio.to_thread(sqlite.close_all)
        self.log.info("stopped CNI thick mode", socket=str(self.path))

    def readiness(self) -> Readiness:
        if self._server is None or not self._server.is_serving():
            return Readiness(False, f"not serving {self.path}")
        return Readiness(True, f"serving {self.path}")

    async def reload(self, section: Config) -> None:
        old, self.section = self.section, section
        if (old.socket, old.workers) != (section.socket, section.workers):
            self.log.info("restarting CNI thick mode for the new config", socket=section.socket)
            await self.stop(grace=5.0)
            self.path = Path(self.ctx.root(section.socket))
            await self.start()

    # ------------------------------------------------------------ serving

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, thick.ProtocolError, TimeoutError) as e:
            self.log.debug("CNI client went away", error=str(e))
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        wait = self.section.handshake_timeout
        # asyncio.timeout rather than wait_for: no task of its own per read (this runs for every request)
        async with asyncio.timeout(wait):
            header = await reader.readexactly(thick.HEADER_SIZE)
        env_size, stdin_size = thick.parse_header(header)
        size = env_size + stdin_size
        if size > self.section.max_request_bytes:
            await self._refuse(reader, writer, size)
            return
        async with asyncio.timeout(wait):
            body = await reader.readexactly(size)
        env, stdin = thick.parse_body(body, env_size)
        if not thick.routes_here(stdin, str(self.path)):
            writer.write(thick.NOT_HERE)
            await writer.drain()
            return
        writer.write(thick.ACK)
        await writer.drain()
        async with asyncio.timeout(wait):
            go = await reader.readexactly(1)
        if go != thick.GO:
            raise thick.ProtocolError("expected GO after ACK")
        command = env.get("CNI_COMMAND", "")
        container_id = env.get("CNI_CONTAINERID", "")
        async with self._locks.hold(container_id):
            started = time.monotonic()
            loop = asyncio.get_running_loop()
            code, out = await loop.run_in_executor(self._executor, self._run, env, stdin)
            seconds = time.monotonic() - started
        cni_code = _result_code(code, out)
        self.requests.labels(command or "none", str(cni_code)).inc()
        self.seconds.labels(command or "none").observe(seconds)
        fields = {"command": command, "container_id": container_id or None, "ifname": env.get("CNI_IFNAME") or None}
        if code == 0:
            self.log.info("CNI request done", ms=round(seconds * 1000, 1), **fields)
        else:
            self.log.warning("CNI request failed", code=cni_code, detail=out[:500], **fields)
        writer.write(thick.encode_reply(code, out.encode()))
        await writer.drain()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> None:
        """NAK a request larger than ``max_request_bytes`` with an error naming the limit, and read the rest of it
        away (for at most the handshake timeout) so the client, still sending, gets to read the answer."""
        limit = self.section.max_request_bytes
        err = CniError(
            INVALID_NETWORK_CONFIG,
            details=f"the request ({size} bytes of environment and network config) is larger than the agent accepts "
            f"({limit} bytes: cni.max_request_bytes in the agent config)",
        )
        self.log.warning("CNI request refused", size=size, limit=limit)
        writer.write(thick.NAK + thick.encode_reply(1, err.to_json().encode()))
        await writer.drain()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(self.section.handshake_timeout):
                while size > 0 and (chunk := await reader.read(min(size, 1 << 16))):
                    size -= len(chunk)

    def _run(self, env: dict[str, str], stdin: bytes) -> tuple[int, str]:
        from cni import skel

        buf = io.StringIO()
        code = skel.run(self._table, env, stdin, buf)
        return code, buf.getvalue()


class _AgentAddresses:
    """Pod addresses told to the network policy plugin when it runs in this agent (:attr:`AgentContext.pod_addresses`),
    else quarantined as the standalone entry point does (:class:`cni.commands.Quarantine`)."""

    def __init__(self, ctx: AgentContext) -> None:
        from cni.commands import Quarantine

        self.ctx = ctx
        self.fallback = Quarantine()

    def added(self, namespace: str, name: str, uid: str, ips: Sequence[str]) -> None:
        hooks = list(self.ctx.pod_addresses)
        if not hooks:
            if namespace and name:  # a Kubernetes pod: its rules may not exist yet
                self.fallback.added(namespace, name, uid, ips)
            return
        for h in hooks:
            h.added(namespace, name, uid, ips)

    def freed(self, ips: Sequence[str]) -> None:
        hooks = list(self.ctx.pod_addresses)
        for h in hooks or [self.fallback]:
            h.freed(ips)


def _listening_socket(path: Path) -> socket.socket:
    """A unix stream socket listening at ``path`` whose file is born with mode 0600: on Linux ``bind`` gives the file
    the socket's own mode (less the umask), so it is set first; there is no moment when others may connect."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(str(path))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def _result_code(exit_code: int, out: str) -> int:
    if exit_code == 0:
        return 0
    try:
        return int(json.loads(out).get("code", 999))
    except (ValueError, AttributeError, TypeError):
        return 999
