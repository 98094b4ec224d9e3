"""The device plugin as the agent shell sees it: every configured resource, the watchers, reload.

Change detection, no polling:

- inotify on every directory a resource's devices may appear in (from :func:`discovery.watch_dirs`, recomputed after
  each scan): only the resources watching a changed directory are scanned again; kernel uevents (sysfs hotplug, which
  inotify cannot see) re-scan the PCI/USB resources, except those of virtual devices (a pod's veth, a loop device);
  a burst of events becomes one re-scan after :data:`DEBOUNCE`; one re-scan runs at a time (discovery reads on each
  resource's scan thread, so the loop keeps answering kubelet), and changes seen meanwhile start another after it;
- inotify on the device-plugins directory (and its parent, in case the directory itself is removed and made again):
  any change there runs :meth:`ResourceRuntime.sync` for every resource at once, which re-serves a resource whose
  socket kubelet removed and re-registers every resource with a new ``kubelet.sock``;
- a safety re-scan and sync every ``rescan_seconds``, and a timer for devices due to be forgotten;
- without inotify (``fs.inotify.max_user_instances`` or ``max_user_watches`` exhausted on a busy node) the plugin
  keeps working: it says so once and re-scans and syncs every :data:`FALLBACK_POLL` seconds instead.

Start removes what a killed agent left for resources no longer configured (their sockets, their CDI specs).

Reload: resources whose config is unchanged keep running (their streams stay open); added ones start, removed ones
stop and remove their socket and CDI spec, changed ones restart. A ``host_root`` or ``register_timeout_seconds``
change restarts every resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import TYPE_CHECKING

from deviceplugin import cdi
from deviceplugin.config import Config, Resource
from deviceplugin.inotify import IN_Q_OVERFLOW, Inotify
from deviceplugin.metrics import DevicePluginMetrics, ResourceStats
from deviceplugin.resource import ResourceRuntime
from deviceplugin.uevent import UeventMonitor
from nodeplug.kube.events import Regarding
from nodeplug.paths import CDI_DIR, DEVICE_PLUGIN_DIR, KUBELET_SOCKET
from nodeplug.plugin import AgentContext, Readiness

if TYPE_CHECKING:  # the DRA driver (and the Kubernetes client under it) is imported only when DRA is on
    from deviceplugin.dra.driver import DraDriver

DEBOUNCE = 0.01
FALLBACK_POLL = 1.0
RELOAD_GRACE = 1.0  # in-flight Allocate calls of a removed or changed resource get this long to finish
UEVENT = "<uevent>"  # pending marker: a kernel uevent, re-scan the resources that read sysfs


class DevicePlugin:
    name = "deviceplugin"

    def __init__(self, section: Config, ctx: AgentContext) -> None:
        self.section = section
        self.ctx = ctx
        self.log = ctx.logger("deviceplugin")
        self.plugin_dir = ctx.root(DEVICE_PLUGIN_DIR)
        self.kubelet_socket = ctx.root(KUBELET_SOCKET)
        self.cdi_dir = ctx.root(CDI_DIR)
        self.metrics = DevicePluginMetrics(ctx.metrics.registry, self._stats)
        self.resources: dict[str, ResourceRuntime] = {}
        self._inotify: Inotify | None = None
        self._uevents: UeventMonitor | None = None
        self._scan_handle: asyncio.TimerHandle | None = None
        self._pending: set[str] | None = set()  # directories that changed since the last scan; None: scan all
        self._sync_handle: asyncio.TimerHandle | None = None
        self._expiry_handle: asyncio.TimerHandle | None = None
        self._safety: asyncio.Task[None] | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._scan_task: asyncio.Task[None] | None = None
        self._scan_again = False
        self._lock = asyncio.Lock()
        self._started = False
        self.dra: DraDriver | None = None
        self.dra_off = ""  # why DRA is off without a driver running (enabled: auto, no Kubernetes API)

    # ------------------------------------------------------------ Plugin protocol

    async def start(self) -> None:
        self.metrics.attach()
        try:
            self.plugin_dir.mkdir(parents=True, exist_ok=True)
            try:
                self._inotify = Inotify(self._on_inotify)
            except OSError as e:
                self.log.warning("no inotify; polling every second instead", error=str(e), poll=FALLBACK_POLL)
            try:
                self._uevents = UeventMonitor(self._on_uevent)
            except OSError as e:
                self.log.info("no kernel uevents; sysfs hotplug is seen by the safety re-scan", error=str(e))
            await asyncio.to_thread(self._remove_leftovers)  # file system work: off the loop, like every other
            async with self._lock:
                for res in self.section.resources:
                    await self._start_resource(res)
            self._rewatch()
            await self._start_dra()
            self._safety = asyncio.create_task(self._safety_loop(), name="deviceplugin-rescan")
            self._started = True
        except BaseException:
            await self.stop(0)
            raise
        self.log.info("started", resources=",".join(self.resources) or None, host_root=self.section.host_root)

    async def stop(self, grace: float) -> None:
        for h in (self._scan_handle, self._sync_handle, self._expiry_handle):
            if h is not None:
                h.cancel()
        self._scan_handle = self._sync_handle = self._expiry_handle = None
        for t in (self._safety, self._sync_task, self._scan_task):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        self._safety = self._sync_task = self._scan_task = None
        if self.dra is not None:
            await self.dra.stop(grace)
            self.dra = None
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        if self._uevents is not None:
            self._uevents.close()
            self._uevents = None
        async with self._lock:
            await asyncio.gather(*(r.stop(grace) for r in self.resources.values()))
            self.resources.clear()
        self.metrics.detach()
        self._started = False

    def readiness(self) -> Readiness:
        if not self._started:
            return Readiness(False, "not started")
        waiting = [
            f"{name}: {'not serving' if not r.serving else 'not registered with kubelet'}"
            for name, r in self.resources.items()
            if r.res.via_deviceplugin and not (r.serving and r.registered)
        ]
        dra_ok, dra_detail = self.dra.ready if self.dra is not None else (True, self.dra_off)
        if waiting:
            return Readiness(False, "; ".join([*waiting, dra_detail] if dra_detail else waiting))
        if not dra_ok:
            return Readiness(False, dra_detail)
        return Readiness(
            True, f"{len(self.resources)} resources registered" + (f"; {dra_detail}" if dra_detail else "")
        )

    async def reload(self, section: Config) -> None:
        async with self._lock:
            old = self.section
            self.section = section
            everything = (old.host_root, old.register_timeout_seconds) != (
                section.host_root,
                section.register_timeout_seconds,
            )
            wanted = {r.name: r for r in section.resources}
            for name in [n for n in self.resources if n not in wanted]:
                await self.resources.pop(name).stop(RELOAD_GRACE, removed=True)
                self.log.info("resource removed", resource=name)
            failed: list[str] = []
            for name, res in wanted.items():
                current = self.resources.get(name)
                if current is not None and current.res == res and not everything:
                    continue
                if current is not None:
                    await self.resources.pop(name).stop(RELOAD_GRACE, removed=current.res.cdi and not res.cdi)
                    self.log.info("resource changed, restarting", resource=name)
                try:
                    await self._start_resource(res)
                except Exception as e:  # the others still start; the shell logs the error
                    self.log.error("resource could not start", resource=name, error=str(e))
                    failed.append(f"{name}: {e}")
            if old.dra != section.dra or everything:
                if self.dra is not None:
                    await self.dra.stop(RELOAD_GRACE, remove=section.dra.enabled is False)
                    self.dra = None
                try:
                    await self._start_dra()
                except Exception as e:
                    self.log.error("DRA driver could not start", error=str(e))
                    failed.append(f"dra: {e}")
            elif self.dra is not None:
                self.dra.attach()  # resources restarted above get the driver's hooks again
        self._rewatch()
        if failed:
            raise RuntimeError("resources not started: " + "; ".join(failed))

    # ------------------------------------------------------------ resources

    def _remove_leftovers(self) -> None:
        """Sockets and CDI specs of resources no longer configured, left by an agent that was killed."""
        sockets = {r.socket_name for r in self.section.resources}
        specs = {cdi.spec_filename(r) for r in self.section.resources if r.cdi}
        leftovers = [p for p in self.plugin_dir.glob("nodeplug-*.sock") if p.name not in sockets and p.is_socket()]
        if self.cdi_dir.is_dir():
            leftovers += [p for p in self.cdi_dir.glob(f"{cdi.VENDOR}-*.json") if p.name not in specs]
        for p in leftovers:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            self.log.info("removed a leftover of an earlier run", path=str(p))

    async def _start_resource(self, res: Resource) -> None:
        rt = ResourceRuntime(
            res,
            host_root=self.section.host_root,
            plugin_dir=self.plugin_dir,
            kubelet_socket=self.kubelet_socket,
            cdi_dir=self.cdi_dir,
            register_timeout=self.section.register_timeout_seconds,
            agent_metrics=self.ctx.metrics,
            metrics=self.metrics,
            log=self.log,
            on_health=functools.partial(self._health_event, res.resource_name),
        )
        await rt.start()
        self.resources[res.name] = rt

    def _health_event(self, resource: str, device: str, reason: str) -> None:
        """An Event on this Node when a device turns unhealthy, and when it is healthy again."""
        if self.ctx.events is None or not self.ctx.node_name:
            return
        node = Regarding.node(self.ctx.node_name)
        if reason:
            self.ctx.events.emit(node, "Warning", "DeviceUnhealthy", f"{resource} device {device}: {reason}", "Health")
        else:
            self.ctx.events.emit(
                node, "Normal", "DeviceHealthy", f"{resource} device {device} is healthy again", "Health"
            )

    async def _start_dra(self) -> None:
        """The DRA driver, as ``dra.enabled`` says: ``auto`` starts it only where the agent follows a Kubernetes API
        (the driver then follows what the API server and kubelet answer), and never imports it otherwise."""
        self.dra_off = ""
        enabled = self.section.dra.enabled
        if enabled is False:
            return
        if enabled == "auto" and (self.ctx.kube is None or not self.ctx.node_name):
            self.dra_off = "DRA off: the agent follows no Kubernetes API (enabled: auto)"
            self.log.info(self.dra_off)
            return
        from deviceplugin.dra.driver import DraDriver

        dra = DraDriver(
            self.section.dra,
            root=self.ctx.root,
            host_root=self.section.host_root,
            runtimes=lambda: self.resources,
            metrics=self.ctx.metrics,
            cdi_dir=self.cdi_dir,
            log=self.log,
            kube=self.ctx.kube,
            node=self.ctx.node_name,
            events=self.ctx.events,
        )
        try:
            await dra.start()
        except BaseException:
            await dra.stop(0)
            raise
        self.dra = dra

    def _stats(self) -> list[ResourceStats]:
        return [r.stats() for r in self.resources.values()]

    # ------------------------------------------------------------ change detection

    def _rewatch(self) -> None:
        if self._inotify is None:
            return
        dirs = {str(self.plugin_dir), str(self.plugin_dir.parent)}
        for r in self.resources.values():
            dirs |= r.watch_dirs
        new = self._inotify.set(dirs)
        if self._started:
            for d in new:
                self._schedule_scan(d)  # entries made between the directory's creation and our watch on it
        self._schedule_expiry()

    def _on_inotify(self, directory: str, name: str, mask: int) -> None:
        kubelet_dirs = (str(self.plugin_dir), str(self.plugin_dir.parent))
        if mask & IN_Q_OVERFLOW or directory in kubelet_dirs:
            self._schedule_sync()
        if mask & IN_Q_OVERFLOW:
            self._schedule_scan(None)
        elif directory not in kubelet_dirs:
            self._schedule_scan(directory)

    def _on_uevent(self, action: str, fields: dict[str, str]) -> None:
        if fields.get("DEVPATH", "").startswith("/devices/virtual/"):
            return  # veths, bridges, loop devices...: never PCI or USB, and a node starting pods makes many
        if action in ("add", "remove", "bind", "unbind", "change", "move", "overflow"):
            self._schedule_scan(UEVENT)

    def _schedule_scan(self, directory: str | None) -> None:
        """Re-scan after :data:`DEBOUNCE` the resources watching ``directory`` (every resource for None)."""
        if directory is None:
            self._pending = None
        elif self._pending is not None:
            self._pending.add(directory)
        if self._scan_handle is None:
            self._scan_handle = asyncio.get_running_loop().call_later(DEBOUNCE, self._scan)

    def _scan(self) -> None:
        self._scan_handle = None
        if self._scan_task is not None and not self._scan_task.done():
            self._scan_again = True  # what changed meanwhile stays pending for the next round
            return
        pending, self._pending = self._pending, set()
        self._scan_task = asyncio.create_task(self._scan_resources(pending), name="deviceplugin-scan")

    async def _scan_resources(self, pending: set[str] | None) -> None:
        """Re-scan the resources watching a directory in ``pending`` (every one for None); then start the next round
        if changes arrived meanwhile."""
        for r in list(self.resources.values()):
            if pending is not None and not (r.watch_dirs & pending) and not (UEVENT in pending and r.reads_sysfs):
                continue
            try:
                await r.rescan()
            except Exception:
                self.log.error("re-scan failed", exc_info=True, resource=r.res.resource_name)
        self._rewatch()
        if self._scan_again:
            self._scan_again = False
            self._scan_task = None  # this task is ending: the next round is a task of its own
            self._scan()

    def _schedule_sync(self) -> None:
        if self._sync_handle is None:
            self._sync_handle = asyncio.get_running_loop().call_later(DEBOUNCE, self._start_sync)

    def _start_sync(self) -> None:
        self._sync_handle = None
        if self._sync_task is not None and not self._sync_task.done():
            self._schedule_sync()  # one sync at a time; run again once this one is done
            return
        self._sync_task = asyncio.create_task(self._sync_all(), name="deviceplugin-sync")

    async def _sync_all(self) -> None:
        async with self._lock:
            if self._inotify is not None and str(self.plugin_dir) not in self._inotify.watched:
                self.plugin_dir.mkdir(parents=True, exist_ok=True)  # the directory itself was removed
                self._rewatch()
            results = await asyncio.gather(*(r.sync() for r in self.resources.values()), return_exceptions=True)
            for r, res in zip(self.resources.values(), results, strict=True):
                if isinstance(res, BaseException):
                    self.log.error("could not serve again", resource=r.res.resource_name, error=str(res))

    def _schedule_expiry(self) -> None:
        if self._expiry_handle is not None:
            self._expiry_handle.cancel()
            self._expiry_handle = None
        due = [t for t in (r.next_expiry() for r in self.resources.values()) if t is not None]
        if due:
            delay = max(0.0, min(due) - time.monotonic()) + 0.001
            self._expiry_handle = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._expiry_handle = None
        for r in self.resources.values():
            r.expire()
        self._rewatch()

    @property
    def polling(self) -> bool:
        """inotify is missing or could not watch everything: poll every :data:`FALLBACK_POLL` seconds."""
        return self._inotify is None or self._inotify.exhausted

    async def _safety_loop(self) -> None:
        warned = False
        while True:
            if self.polling and not warned and self._inotify is not None:
                self.log.warning("inotify watches exhausted (fs.inotify.max_user_watches); polling every second")
                warned = True
            await asyncio.sleep(FALLBACK_POLL if self.polling else self.section.rescan_seconds)
            self._pending = None
            self._scan()
            self._schedule_sync()
