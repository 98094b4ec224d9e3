"""The agent's CNI plugin: serves thick mode on ``/run/nodeplug/cni.sock`` (under the agent's root).

The connections are served on threads (:mod:`cni.thickserver`: the framing of :mod:`cni.thick`, ACK, GO); after GO
each invocation runs the very same protocol code the standalone entry point runs (:func:`cni.skel.run` over
:mod:`cni.commands` and :mod:`cni.dataplane`), at most ``workers`` at once. Requests for the same container id are
serialised (an ADD and the DEL that follows a failed sandbox never overlap); different containers run concurrently.
A request larger than ``max_request_bytes`` is answered with an error naming the limit (NAK), never run, and never
left to a silent fallback; a config naming another agent's socket gets NOT_HERE.

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
import importlib
import io
import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from prometheus_client import Counter, Histogram

from cni.config import Config
from cni.skel import Handler
from cni.thickserver import ThickServer
from nodeplug.keyedlocks import ThreadKeyedLocks
from nodeplug.metrics import RPC_BUCKETS
from nodeplug.plugin import AgentContext, Readiness

CONNECTIONS = 64  # connections served at once (each on a thread); the workers among them run commands


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
        self._server: ThickServer | None = None
        self._slots = threading.BoundedSemaphore(section.workers)
        self._table: Mapping[str, Handler] = {}
        self._locks = ThreadKeyedLocks()
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
        self._slots = threading.BoundedSemaphore(self.section.workers)
        server = ThickServer(
            self.path,
            self._run,
            connections=max(CONNECTIONS, self.section.workers),
            max_request_bytes=self.section.max_request_bytes,
            handshake_timeout=self.section.handshake_timeout,
            log=self.log,
        )
        await asyncio.to_thread(server.start)
        self._server = server
        self.log.info("serving CNI thick mode", socket=str(self.path), workers=self.section.workers)

    async def stop(self, grace: float) -> None:
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.stop, grace)
        from cni.ipam import sqlite

        # close_all takes each store's lock, which a worker still finishing a transaction may hold for up to the
        # busy timeout: not on the event loop
        await asyncio.to_thread(sqlite.close_all)
        self.log.info("stopped CNI thick mode", socket=str(self.path))

    def readiness(self) -> Readiness:
        if self._server is None or not self._server.serving:
            return Readiness(False, f"not serving {self.path}")
        return Readiness(True, f"serving {self.path}")

    async def reload(self, section: Config) -> None:
        old, self.section = self.section, section
        if (old.socket, old.workers) != (section.socket, section.workers):
            self.log.info("restarting CNI thick mode for the new config", socket=section.socket)
            await self.stop(grace=5.0)
            self.path = Path(self.ctx.root(section.socket))
            await self.start()
        elif self._server is not None:  # read by each connection as it is served
            self._server.max_request_bytes = section.max_request_bytes
            self._server.handshake_timeout = section.handshake_timeout

    # ------------------------------------------------------------ serving

    def _run(self, env: dict[str, str], stdin: bytes) -> tuple[int, str]:
        """One invocation, on the connection's thread: after the container's earlier requests, in one of the
        ``workers`` slots."""
        from cni import skel

        command = env.get("CNI_COMMAND", "")
        container_id = env.get("CNI_CONTAINERID", "")
        with self._locks.hold(container_id):
            started = time.monotonic()
            with self._slots:
                buf = io.StringIO()
                code = skel.run(self._table, env, stdin, buf)
                out = buf.getvalue()
            seconds = time.monotonic() - started
        cni_code = _result_code(code, out)
        self.requests.labels(command or "none", str(cni_code)).inc()
        self.seconds.labels(command or "none").observe(seconds)
        fields = {"command": command, "container_id": container_id or None, "ifname": env.get("CNI_IFNAME") or None}
        if code == 0:
            self.log.info("CNI request done", ms=round(seconds * 1000, 1), **fields)
        else:
            self.log.warning("CNI request failed", code=cni_code, detail=out[:500], **fields)
        return code, out


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


def _result_code(exit_code: int, out: str) -> int:
    if exit_code == 0:
        return 0
    try:
        return int(json.loads(out).get("code", 999))
    except (ValueError, AttributeError, TypeError):
        return 999
