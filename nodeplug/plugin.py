"""What the agent shell expects of a plugin, and what it hands to one.

A plugin package describes itself with one :class:`PluginSpec` (in its ``spec`` module, which imports nothing but
its config section and this shell, so that loading the config loads no plugin's code):

- ``name``: its config section's key, its name in ``/readyz`` and its log field;
- ``section``: the :class:`nodeplug.configbase.Section` subclass of its config, and ``of``, which picks that section
  out of the agent config;
- ``load() -> Implementation``: imports the plugin's code when the agent starts it or ``nodeplug doctor`` checks
  it, and returns ``create(section, ctx) -> Plugin``, which builds the plugin (no side effects until ``start``), and
  ``checks(section, ctx) -> list[Check]``, its node and end-to-end checks;
- ``needs_kube``: the plugin only runs when the agent follows a Kubernetes API (a controller of API objects);
- ``needs``: the sections that must be enabled for it to run (network policy acts on the pods the CNI attaches);
- ``commands``: ``nodeplug`` subcommands it brings (``install-cni``).

The shell names the plugins in one place, :mod:`nodeplug.plugins`, starts the enabled ones in that order, serves
``/readyz`` from :meth:`Plugin.readiness`, hands a changed section to :meth:`Plugin.reload` (SIGHUP or config-file
change) and calls :meth:`Plugin.stop` on SIGTERM/SIGINT. Each plugin sees its own section's type, never ``Any``:
:meth:`PluginSpec.start` binds a running plugin to its spec (:class:`Running`), and the shell holds running plugins
through the :class:`Started` protocol, whose methods take the whole agent config.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from nodeplug.configbase import Section
from nodeplug.log import Logger, get_logger
from nodeplug.metrics import Metrics
from nodeplug.paths import Root

if TYPE_CHECKING:
    from nodeplug.checks import Check
    from nodeplug.config import AgentConfig
    from nodeplug.kube import KubeClient
    from nodeplug.kube.events import EventRecorder
    from nodeplug.kube.health import ApiHealth


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str = ""


class PodAddressHook(Protocol):
    def added(self, namespace: str, name: str, uid: str, ips: Sequence[str]) -> None: ...

    def freed(self, ips: Sequence[str]) -> None: ...


@dataclass
class AgentContext:
    """Everything the shell shares with the plugins."""

    root: Root = field(default_factory=Root)
    metrics: Metrics = field(default_factory=Metrics)
    config_path: Path | None = None
    # The Kubernetes API client (nodeplug.kube), None in single-node mode; and this node's name in that API.
    kube: KubeClient | None = None
    node_name: str = ""
    # Kubernetes Events about this node and the objects the agent serves, and whether the API server answers now
    # (both None in single-node mode).
    events: EventRecorder | None = None
    api_health: ApiHealth | None = None
    # Told by the CNI server of a pod's addresses before ADD answers and before DEL frees them: the network policy
    # registers here while it runs (called on the CNI server's worker threads; each call blocks until done).
    pod_addresses: list[PodAddressHook] = field(default_factory=list)

    def logger(self, plugin: str, **bound: Any) -> Logger:
        return get_logger(plugin, **bound)


S = TypeVar("S", bound=Section)
S_contra = TypeVar("S_contra", bound=Section, contravariant=True)


class Plugin(Protocol[S_contra]):
    name: str

    async def start(self) -> None:
        """Create sockets and start serving; raise to abort agent start-up (the shell then stops the others)."""

    async def stop(self, grace: float) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds) and remove every socket this plugin created."""

    def readiness(self) -> Readiness:
        """Serving, and registered with kubelet where that applies."""

    async def reload(self, section: S_contra) -> None:
        """Apply a new, already validated section; a plugin that cannot reload in place restarts itself."""


@dataclass(frozen=True)
class Command:
    """A ``nodeplug`` subcommand a plugin brings: ``run`` returns the exit status."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class Started(Protocol):
    """A running plugin as the shell holds it."""

    @property
    def name(self) -> str: ...

    def readiness(self) -> Readiness: ...

    async def stop(self, grace: float) -> None: ...

    def changed(self, cfg: AgentConfig) -> bool:
        """Whether ``cfg`` holds another section for this plugin than the one it runs with."""

    async def reload(self, cfg: AgentConfig) -> None:
        """Hand this plugin its section of ``cfg``."""


class Spec(Protocol):
    """A plugin as the shell knows it before it runs (any :class:`PluginSpec`)."""

    @property
    def name(self) -> str: ...

    @property
    def commands(self) -> Sequence[Command]: ...

    def enabled(self, cfg: AgentConfig) -> bool: ...

    def wanted(self, cfg: AgentConfig, ctx: AgentContext) -> bool: ...

    def needs_off(self, cfg: AgentConfig) -> list[str]: ...

    def disabled_reason(self, cfg: AgentConfig, ctx: AgentContext) -> str: ...

    async def start(self, cfg: AgentConfig, ctx: AgentContext) -> Started: ...

    def doctor_checks(self, cfg: AgentConfig, ctx: AgentContext) -> list[Check]: ...


@dataclass(frozen=True)
class Implementation(Generic[S]):
    """A plugin's code, as its spec's ``load`` returns it: how the plugin is built, and its doctor checks."""

    create: Callable[[S, AgentContext], Plugin[S]]
    checks: Callable[[S, AgentContext], list[Check]]


@dataclass(frozen=True)
class PluginSpec(Generic[S]):
    name: str
    section: type[S]
    of: Callable[[AgentConfig], S]
    load: Callable[[], Implementation[S]]
    needs_kube: bool = False
    needs: tuple[str, ...] = ()
    commands: Sequence[Command] = ()

    def enabled(self, cfg: AgentConfig) -> bool:
        """The section says ``enabled: true``."""
        return self.of(cfg).enabled

    def wanted(self, cfg: AgentConfig, ctx: AgentContext) -> bool:
        """Enabled, and able to run here (a plugin that follows the API runs only when the agent does)."""
        return not self.disabled_reason(cfg, ctx)

    def needs_off(self, cfg: AgentConfig) -> list[str]:
        """The sections this plugin needs that the config turns off."""
        needed: list[Section] = [getattr(cfg, n) for n in self.needs]
        return [n for n, section in zip(self.needs, needed, strict=True) if not section.enabled]

    def disabled_reason(self, cfg: AgentConfig, ctx: AgentContext) -> str:
        if not self.of(cfg).enabled:
            return f"{self.name}.enabled is false"
        if self.needs_kube and ctx.kube is None:
            return "no Kubernetes API configured (--kubeconfig, KUBECONFIG or in-cluster): single-node"
        off = self.needs_off(cfg)
        if off:
            return f"it needs {', '.join(off)}, which the config turns off ({', '.join(n + '.enabled' for n in off)})"
        return ""

    async def start(self, cfg: AgentConfig, ctx: AgentContext) -> Started:
        section = self.of(cfg)
        plugin = self.load().create(section, ctx)
        try:
            await plugin.start()
        except BaseException:
            with contextlib.suppress(Exception):  # the start's own failure is the one to report
                await plugin.stop(0)
            raise
        return Running(self, plugin, section)

    def doctor_checks(self, cfg: AgentConfig, ctx: AgentContext) -> list[Check]:
        return self.load().checks(self.of(cfg), ctx)


@dataclass
class Running(Generic[S]):
    spec: PluginSpec[S]
    plugin: Plugin[S]
    section: S

    @property
    def name(self) -> str:
        return self.spec.name

    def readiness(self) -> Readiness:
        return self.plugin.readiness()

    async def stop(self, grace: float) -> None:
        await self.plugin.stop(grace)

    def changed(self, cfg: AgentConfig) -> bool:
        return self.spec.of(cfg) != self.section

    async def reload(self, cfg: AgentConfig) -> None:
        section = self.spec.of(cfg)
        await self.plugin.reload(section)
        self.section = section
