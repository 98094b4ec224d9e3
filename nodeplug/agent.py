"""The agent: one asyncio process running the plugins the config enables.

Start-up order: validate the whole config (done by the caller), start the HTTP endpoint, then each enabled plugin
in the order of :mod:`nodeplug.plugins` (``deviceplugin``, ``csi``, ``cni``, ``cluster_network``; a plugin that
follows the API runs only when the agent does). If a plugin fails to start, the ones already started are stopped
and the agent exits non-zero. SIGTERM/SIGINT stop the plugins in reverse order, each giving in-flight RPCs
``shutdown_grace_seconds``, and the agent exits 0 with its sockets removed.

Kubernetes API: given a :class:`~nodeplug.kube.KubeSource` (``--kubeconfig``, ``KUBECONFIG`` or the in-cluster
service account), the agent makes one :class:`~nodeplug.kube.KubeClient` before the plugins start and hands it to them
in the context (no request is made at that point: start-up never waits for the API server), with an
:class:`~nodeplug.kube.events.EventRecorder` for the Events the plugins record; both are closed after the plugins
stop. Without one the plugins run single-node.

Reload: SIGHUP, or a change of the config file's content (checked every second; ConfigMap updates swap symlinks, so
content is compared, not inotify events), loads the file again. An invalid file is rejected with one log line per
problem and the running config stays. A section whose content changed is handed to its plugin's ``reload``; a plugin
enabled or disabled is started or stopped. ``root`` and ``http`` changes need a restart and are logged as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from nodeplug.config import AgentConfig, ConfigError, load
from nodeplug.httpserver import HealthServer
from nodeplug.log import get_logger
from nodeplug.metrics import ReadinessCollector
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext, Readiness, Spec, Started
from nodeplug.plugins import PLUGINS

if TYPE_CHECKING:
    from nodeplug.kube import KubeSource

CONFIG_POLL_SECONDS = 1.0

log = get_logger("agent")


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        config_path: Path | None = None,
        root_override: Path | None = None,
        kube: KubeSource | None = None,
        node_name: str = "",
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.root_override = root_override
        self.kube_source = kube
        self.ctx = AgentContext(root=Root(cfg.root), config_path=config_path, node_name=node_name)
        self.plugins: dict[str, Started] = {}
        self._starting: str = ""  # the plugin whose start is under way (its sockets may already be there)
        self.http = HealthServer(cfg.http.host, cfg.http.port, self.ctx.metrics, self.readiness)
        self.ctx.metrics.registry.register(
            ReadinessCollector(lambda: {name: r.ready for name, r in self.readiness().items()})
        )
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._config_digest = self._digest()

    # ------------------------------------------------------------------ lifecycle

    def readiness(self) -> dict[str, Readiness]:
        out: dict[str, Readiness] = {}
        for name, plugin in self.plugins.items():
            try:
                out[name] = plugin.readiness()
            except Exception as e:  # a broken readiness() must not take /readyz down
                out[name] = Readiness(False, f"readiness check failed: {e}")
        if self._starting and self._starting not in out:
            out[self._starting] = Readiness(False, "starting")
        return out

    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        self._reload.set()

    async def start(self) -> None:
        for note in self.cfg.notes:
            log.warning("config", note=note)
        await self.http.start()
        if self.kube_source is not None:
            from nodeplug.kube import KubeClient
            from nodeplug.kube.events import EventRecorder
            from nodeplug.kube.health import ApiHealth

            self.ctx.kube = KubeClient(self.kube_source)
            self.ctx.events = EventRecorder(self.ctx.kube, self.ctx.node_name, self.ctx.metrics.registry)
            await self.ctx.events.start()
            self.ctx.api_health = ApiHealth(self.ctx.kube)
            await self.ctx.api_health.start()
            log.info("following the Kubernetes API", origin=self.kube_source.origin, node=self.ctx.node_name)
        try:
            for spec in PLUGINS:
                if spec.wanted(self.cfg, self.ctx):
                    await self._start_plugin(spec)
                elif spec.enabled(self.cfg):
                    log.info("plugin not started", name=spec.name, reason=spec.disabled_reason(self.cfg, self.ctx))
        except BaseException:
            await self.stop()
            raise

    async def _start_plugin(self, spec: Spec) -> None:
        log.info("starting plugin", name=spec.name)
        self._starting = spec.name
        try:
            self.plugins[spec.name] = await spec.start(self.cfg, self.ctx)
        finally:
            self._starting = ""

    async def stop(self) -> None:
        grace = self.cfg.shutdown_grace_seconds
        for name in reversed(list(self.plugins)):
            plugin = self.plugins.pop(name)
            log.info("stopping plugin", name=name)
            try:
                await asyncio.wait_for(plugin.stop(grace), grace + 10)
            except Exception as e:
                log.error("plugin did not stop cleanly", name=name, error=repr(e))
        if self.ctx.api_health is not None:
            health, self.ctx.api_health = self.ctx.api_health, None
            await health.stop()
        if self.ctx.events is not None:
            events, self.ctx.events = self.ctx.events, None
            with contextlib.suppress(Exception):
                await events.stop()
        if self.ctx.kube is not None:
            kube, self.ctx.kube = self.ctx.kube, None
            with contextlib.suppress(Exception):
                await kube.close()
        await self.http.stop()

    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, stop. Returns the process exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        try:
            try:
                await self.start()
            except Exception as e:
                log.error("agent failed to start", error=str(e) or repr(e))
                return 1
            log.info("agent running", root=str(self.cfg.root), plugins=",".join(self.plugins) or "none")
            watcher = asyncio.create_task(self._watch_config())
            reloader = asyncio.create_task(self._reload_loop())
            await self._stop.wait()
            log.info("shutting down")
            for task in (watcher, reloader):
                task.cancel()
            for task in (watcher, reloader):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.stop()
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    # ------------------------------------------------------------------ reload

    def _digest(self) -> str | None:
        if self.config_path is None:
            return None
        try:
            return hashlib.sha256(self.config_path.read_bytes()).hexdigest()
        except OSError:
            return None

    async def _watch_config(self) -> None:
        if self.config_path is None:
            return
        while True:
            await asyncio.sleep(CONFIG_POLL_SECONDS)
            digest = self._digest()
            if digest is not None and digest != self._config_digest:
                self._reload.set()

    async def _reload_loop(self) -> None:
        while True:
            await self._reload.wait()
            self._reload.clear()
            await self.reload()

    async def reload(self) -> bool:
        """Load the config file again and apply what changed; False when the new file was rejected."""
        self._config_digest = self._digest()
        if self.config_path is None:
            log.info("reload requested, but the agent runs on built-in defaults: nothing to do")
            return True
        try:
            new = load(self.config_path, self.root_override)
        except ConfigError as e:
            log.error("new config rejected; keeping the running one", source=e.source)
            for problem in e.problems:
                log.error("config problem", problem=problem)
            return False
        for field in ("root", "http", "log_level", "shutdown_grace_seconds"):
            if getattr(new, field) != getattr(self.cfg, field):
                log.warning("config change needs an agent restart to take effect", field=field)
        for note in new.notes:
            log.warning("config", note=note)
        new = new.model_copy(update={"root": self.cfg.root, "http": self.cfg.http})
        for spec in PLUGINS:
            name, running = spec.name, self.plugins.get(spec.name)
            wanted = spec.wanted(new, self.ctx)
            try:
                if running is not None and not wanted:
                    log.info("plugin disabled by new config", name=name)
                    await self.plugins.pop(name).stop(self.cfg.shutdown_grace_seconds)
                elif running is None and wanted:
                    await self._start_plugin(spec)
                elif running is not None and running.changed(new):
                    log.info("reloading plugin", name=name)
                    await running.reload(new)
            except Exception as e:
                log.error("applying new config failed", name=name, error=str(e) or repr(e))
        self.cfg = new
        log.info("config reloaded", source=str(self.config_path))
        return True
