"""One resource at run time: its device table, its socket, its registration with kubelet, its health checks.

Lifecycle (the plugin drives it; all calls happen in the event loop)::

    start()      discover, serve the socket, then register (retrying with backoff until kubelet answers)
    rescan()     discovery again (the plugin calls it on inotify/uevent, debounced, and on the safety timer)
    sync()       our socket still ours? kubelet.sock the one we registered with? re-serve / re-register if not
    stop()       end the streams, stop serving, remove the socket (and the CDI spec when the resource is removed)

Registration runs in one task that waits for a kick (start, re-serve, a new kubelet.sock) and retries with
exponential backoff (50 ms to 5 s) while kubelet is not there, logging once per change of state. The health task
runs the health command for every present device every ``interval_seconds``. With ``cdi: true``, a task of the
resource's own writes its CDI spec on a worker thread after every change, and the changed listing reaches kubelet
once the spec names it: a slow disk holds back this resource's listing, never the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ParamSpec, TypeVar

from deviceplugin import cdi, discovery, health
from deviceplugin.broadcast import Broadcast
from deviceplugin.config import HealthSpec, Resource
from deviceplugin.metrics import DevicePluginMetrics, ResourceStats
from deviceplugin.registration import Identity, describe, identity, register
from deviceplugin.servicer import DevicePluginServicer, listing_message
from deviceplugin.state import DeviceTable, Listed, Snapshot
from nodeplug.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.log import Logger
from nodeplug.metrics import Metrics

BACKOFF_MIN = 0.05
BACKOFF_MAX = 5.0

P = ParamSpec("P")
T = TypeVar("T")


def backoff() -> Iterator[float]:
    """The waits between Register attempts while kubelet is not there: doubling from :data:`BACKOFF_MIN` up to
    :data:`BACKOFF_MAX`. A kick (a new kubelet.sock, our socket served again) ends a wait early."""
    delay = BACKOFF_MIN
    while True:
        yield delay
        delay = min(delay * 2, BACKOFF_MAX)


def _discover(res: Resource, host_root: str) -> tuple[discovery.Discovery, set[str]]:
    """The blocking part of a scan (reads /dev and /sys): run on the resource's scan thread."""
    found = discovery.discover(res, host_root)
    return found, discovery.watch_dirs(res, host_root, found.devices)


class ResourceRuntime:
    """One resource's devices, socket and registration. Discovery reads /dev and /sys on a thread of its own (a full
    PCI scan of a large host takes a second): the event loop keeps answering meanwhile, and the result is applied
    on the loop, so the device table, the streams and the CDI spec are only ever touched there."""

    def __init__(
        self,
        res: Resource,
        *,
        host_root: str,
        plugin_dir: Path,
        kubelet_socket: Path,
        cdi_dir: Path,
        register_timeout: float,
        agent_metrics: Metrics,
        metrics: DevicePluginMetrics,
        log: Logger,
        on_health: Callable[[str, str], None] | None = None,
    ) -> None:
        self.res = res
        # told (device ID, reason; "" when healthy again) each time a physical device turns unhealthy or recovers
        self.on_health = on_health
        self._told: dict[str, str] = {}
        self.host_root = host_root
        self.socket = plugin_dir / res.socket_name
        self.kubelet_socket = kubelet_socket
        self.cdi_dir = cdi_dir
        self.register_timeout = register_timeout
        self.agent_metrics = agent_metrics
        self.metrics = metrics
        self.log = log.bind(resource=res.resource_name)
        self.table = DeviceTable(res.replicas, res.forget_after_seconds, checked=res.health is not None)
        self.updates: Broadcast[api_pb2.ListAndWatchResponse] = Broadcast(api_pb2.ListAndWatchResponse())
        self.watch_dirs: set[str] = set()
        self.registered = False
        self._server: UnixGrpcServer | None = None
        self._socket_id: Identity | None = None
        self._kubelet_id: Identity | None = None  # the kubelet.sock we registered with
        self._kubelet_seen: Identity | None = None  # the kubelet.sock seen at the last sync
        self._kick = asyncio.Event()
        self._health_kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._problems: list[str] = []
        self._cdi_written: str | None = None  # the spec's text as last written ("" no file; None not known)
        self._cdi_ids: frozenset[str] = frozenset()  # the IDs that spec names
        self._cdi_dirty = False  # the last write failed: Allocate writes before answering
        self._cdi_lock = asyncio.Lock()  # one spec write at a time, each from the listing as it is when its turn comes
        self._cdi_task: asyncio.Task[None] | None = None  # writes the spec, then publishes the listing
        self._cdi_changes = 0  # listing changes seen by that task
        self._unpublished = False  # a changed listing waits for its spec
        self._reg_state = ""
        self._serve_lock = asyncio.Lock()
        # one worker: preferences are computed one at a time, and a flood of calls queues instead of taking threads
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"deviceplugin-{res.name}")
        # one scanner: scans of a resource run one after another, so their results are applied in the order read
        self._scanner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"deviceplugin-scan-{res.name}")
        self._stopped = False
        self.on_change: Callable[[], None] | None = None  # the DRA driver's: devices or their health changed
        self.on_allocate: Callable[[str, list[Listed]], None] | None = None  # the DRA driver's: Allocate answered

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.rescan()
        if self._cdi_task is not None:
            await self._cdi_task  # the first listing kubelet gets is the whole one, its spec written
        if not self.res.via_deviceplugin:  # offered through DRA only: discovery and health, no socket
            if self.res.health is not None:
                self._tasks.append(asyncio.create_task(self._health_loop(), name=f"health-{self.res.name}"))
            return
        await self._serve()
        self._tasks.append(asyncio.create_task(self._register_loop(), name=f"register-{self.res.name}"))
        if self.res.health is not None:
            self._tasks.append(asyncio.create_task(self._health_loop(), name=f"health-{self.res.name}"))
        self._kick.set()

    async def stop(self, grace: float, removed: bool = False) -> None:
        self._stopped = True  # a scan still reading is not applied
        if self._cdi_task is not None:
            self._tasks.append(self._cdi_task)
            self._cdi_task = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        self.updates.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        self.registered = False
        self._worker.shutdown(wait=False, cancel_futures=True)  # a preference in progress ends within milliseconds
        self._scanner.shutdown(wait=False)  # a scan in progress finishes on its thread; its result is dropped
        if removed:
            async with self._cdi_lock:  # after a write still in flight, not before it
                await asyncio.to_thread(cdi.remove_spec, self.cdi_dir, self.res)
        self.log.info("stopped", removed=removed or None)

    @property
    def reads_sysfs(self) -> bool:
        """PCI/USB matchers: sysfs hotplug is announced by kernel uevents, not inotify."""
        return bool(self.res.pci or self.res.usb)

    @property
    def serving(self) -> bool:
        return self._server is not None and identity(self.socket, with_ctime=False) == self._socket_id

    def set_held(self, held: dict[str, str]) -> None:
        """Physical devices prepared for DRA claims: kubelet's device manager sees them unhealthy meanwhile."""
        if self.table.set_held(held):
            self.updates.publish(listing_message(self.table.listing))

    def allocated(self, entries: list[Listed]) -> None:
        if self.on_allocate is not None:
            self.on_allocate(self.res.name, entries)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def stats(self) -> ResourceStats:
        healthy = sum(1 for e in self.table.listing if e.healthy)
        return ResourceStats(
            self.res.name, healthy, len(self.table.listing) - healthy, self.registered, self.updates.subscribers
        )

    # ------------------------------------------------------------ discovery and health

    async def rescan(self) -> bool:
        """Discover again (on the scan thread); publish when what kubelet sees changed. Returns whether it did."""
        if self._stopped:
            return False
        found, dirs = await asyncio.get_running_loop().run_in_executor(
            self._scanner, _discover, self.res, self.host_root
        )
        if self._stopped:  # stopped (a reload, the agent's shutdown) while the scan was reading
            return False
        self.metrics.scans.labels(self.res.name).inc()
        return self._apply(found, dirs)

    def _apply(self, found: discovery.Discovery, dirs: set[str]) -> bool:
        if found.problems != self._problems:
            for p in found.problems:
                self.log.warning("discovery", problem=p)
            self._problems = found.problems
        before = {d.id for d in self.table.devices()}
        changed = self.table.update(found.devices, time.monotonic())
        if {d.id for d in found.devices} - before:
            self._health_kick.set()  # check new devices now, not at the next interval
        self.watch_dirs = dirs
        self._after_change(changed)
        return changed

    def expire(self) -> None:
        self._after_change(self.table.expire(time.monotonic()))

    def next_expiry(self) -> float | None:
        return self.table.next_expiry()

    def _after_change(self, changed: bool) -> None:
        """Tell the DRA driver at once; kubelet once the CDI spec names the listing's IDs (a write that failed is
        retried by Allocate before it answers), from a task of the resource's own: a slow or stuck disk delays this
        resource's listing only, never the scan of the others."""
        if changed:
            self._changed()
        if not self.res.cdi:
            if changed:
                self._publish()
            return
        self._unpublished |= changed
        self._cdi_changes += 1
        if self._cdi_task is None or self._cdi_task.done():
            self._cdi_task = asyncio.create_task(self._write_then_publish(), name=f"cdi-{self.res.name}")

    async def _write_then_publish(self) -> None:
        while not self._stopped:
            seen = self._cdi_changes
            try:
                await self._sync_cdi()
            except OSError as e:
                self._cdi_dirty = True
                self.log.error("CDI spec not written", dir=str(self.cdi_dir), error=str(e))
            if seen != self._cdi_changes and not self._cdi_dirty:
                continue  # the listing moved on while the spec was written: write that first
            if self._unpublished and not self._stopped:
                self._unpublished = False
                self._publish()
            if seen == self._cdi_changes:
                return

    def _publish(self) -> None:
        self.updates.publish(listing_message(self.table.listing))
        self._tell_health()
        sick = [e.id for e in self.table.listing if not e.healthy]
        self.log.info(
            "devices changed",
            total=len(self.table.listing),
            unhealthy=len(sick),
            unhealthy_ids=(",".join(sick[:10]) + (",..." if len(sick) > 10 else "")) or None,
        )

    async def _sync_cdi(self, force: bool = False) -> None:
        """Bring the spec file to the current listing on a worker thread: a write is two fsyncs and a rename, which
        a slow or stuck disk can hold for seconds, and the event loop serves every resource, DRA and the agent."""
        async with self._cdi_lock:
            if self._stopped:
                return
            listing = self.table.listing
            text = await asyncio.to_thread(cdi.sync_spec, self.cdi_dir, self.res, listing, self._cdi_written, force)
            self._cdi_written = text
            self._cdi_ids = frozenset(e.id for e in listing)
            self._cdi_dirty = False
            self.log.debug("CDI spec up to date", path=str(self.cdi_dir / cdi.spec_filename(self.res)))

    async def ensure_cdi_spec(self, ids: Iterable[str]) -> None:
        """Allocate calls this before it names CDI devices: the spec on disk must name ``ids``. It may not yet (a write
        still in flight, or one that failed) or someone removed it: then it is written now (OSError if it cannot)."""
        if not self._cdi_dirty and self._cdi_ids.issuperset(ids) and self.spec_path.exists():
            return
        await self._sync_cdi(force=True)

    @property
    def spec_path(self) -> Path:
        return self.cdi_dir / cdi.spec_filename(self.res)

    async def _health_loop(self) -> None:
        spec = self.res.health
        assert spec is not None
        while True:
            self._health_kick.clear()
            try:
                await self._check_health(spec)
            except Exception:  # keep checking: a bug here must not freeze every device's health
                self.log.error("health check round failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._health_kick.wait(), spec.interval_seconds)

    async def _check_health(self, spec: HealthSpec) -> None:
        results = await health.check_all(spec, self.table.devices(), self.host_root)
        changed = False
        for dev_id, failure in results.items():
            before = self.table.reason(dev_id)
            changed |= self.table.set_command_health(dev_id, failure)
            after = self.table.reason(dev_id)
            if before != after:
                self.log.info("health", device_id=dev_id, healthy=not after, reason=after or None)
        if changed:
            self._changed()
            self.updates.publish(listing_message(self.table.listing))
            self._tell_health()

    def _tell_health(self) -> None:
        """Each physical device whose health reason changed since it was last told, once (not per replica)."""
        if self.on_health is None:
            return
        now = {dev_id: self.table.reason(dev_id) for dev_id in {e.device.id for e in self.table.listing}}
        for dev_id, reason in now.items():
            if reason != self._told.get(dev_id, ""):
                self.on_health(dev_id, reason)
        self._told = {k: v for k, v in now.items() if v}

    # ------------------------------------------------------------ Allocate support

    def lookup(self, replica_id: str) -> Listed | None:
        return self.table.get(replica_id)

    def snapshot(self) -> Snapshot:
        return self.table.snapshot

    async def offload(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))

    async def reset(self, entries: list[Listed]) -> None:
        if self.res.reset is not None:
            await health.reset(self.res.reset, [e.device for e in entries], self.host_root)

    # ------------------------------------------------------------ serving and registration

    async def _serve(self) -> None:
        async with self._serve_lock:
            if self._server is not None:
                await self._server.stop(0)
            server = UnixGrpcServer(self.socket, plugin="deviceplugin", metrics=self.agent_metrics, log=self.log)
            server.add(api_pb2_grpc.add_DevicePluginServicer_to_server, DevicePluginServicer(self))
            await server.start()
            self._server = server
            self._socket_id = identity(self.socket, with_ctime=False)

    async def sync(self) -> None:
        """Re-serve when our socket is gone or replaced; re-register when kubelet.sock is new or gone."""
        if self.updates.closed or not self.res.via_deviceplugin:
            return
        if identity(self.socket, with_ctime=False) != self._socket_id:
            self.log.info("socket removed, serving again", socket=str(self.socket))
            self.registered = False
            self._reg_state = ""
            await self._serve()
            self._kick.set()
        current = identity(self.kubelet_socket)
        if current == self._kubelet_seen:
            return
        self._kubelet_seen = current
        if current != self._kubelet_id:  # kubelet restarted (or went away): register with the new one
            if self.registered:
                self.registered = False
                self._reg_state = ""  # log the outcome of the next attempt, whatever it is
            self._kick.set()

    async def _register_loop(self) -> None:
        while True:
            await self._kick.wait()
            delays = backoff()
            while True:
                self._kick.clear()
                kubelet_id = identity(self.kubelet_socket)
                if self.registered and kubelet_id == self._kubelet_id:
                    break  # a second kick for the kubelet we already registered with
                try:
                    await register(self.kubelet_socket, self.res, self.register_timeout)
                except Exception as e:
                    self.registered = False
                    self.metrics.registrations.labels(self.res.name, "error").inc()
                    self._state(f"not registered: {describe(e)}", warn=True)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._kick.wait(), next(delays))
                    continue
                self._kubelet_id = kubelet_id
                self.registered = True
                self.metrics.registrations.labels(self.res.name, "ok").inc()
                self._state("registered")
                break

    def _state(self, state: str, warn: bool = False) -> None:
        if state != self._reg_state:
            self._reg_state = state
            (self.log.warning if warn else self.log.info)(state, kubelet=str(self.kubelet_socket))
