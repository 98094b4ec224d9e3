"""What the agent shell expects of a plugin, and what it hands to one.

Each plugin package (``deviceplugin``, ``csi``, ``cni``) exposes:

- ``<pkg>.config``: a :class:`nodeplug.configbase.Section` subclass, the plugin's section of the agent config;
- ``<pkg>.plugin.create(section, ctx) -> Plugin``: builds the plugin (no side effects until ``start``);
- ``<pkg>.doctor.checks(section, ctx) -> list[nodeplug.doctor.Check]``: the plugin's node and end-to-end checks.

The shell starts the enabled plugins in order, serves ``/readyz`` from :meth:`Plugin.readiness`, hands a changed
section to :meth:`Plugin.reload` (SIGHUP or config-file change) and calls :meth:`Plugin.stop` on SIGTERM/SIGINT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nodeplug.log import Logger, get_logger
from nodeplug.metrics import Metrics
from nodeplug.paths import Root

if TYPE_CHECKING:
    from nodeplug.kube import KubeClient


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str = ""


@dataclass
class AgentContext:
    """Everything the shell shares with the plugins."""

    root: Root = field(default_factory=Root)
    metrics: Metrics = field(default_factory=Metrics)
    config_path: Path | None = None
    # The Kubernetes API client (nodeplug.kube), None in single-node mode; and this node's name in that API.
    kube: KubeClient | None = None
    node_name: str = ""

    def logger(self, plugin: str, **bound: Any) -> Logger:
        return get_logger(plugin, **bound)


class Plugin(Protocol):
    name: str

    async def start(self) -> None:
        """Create sockets and start serving; raise to abort agent start-up (the shell then stops the others)."""

    async def stop(self, grace: float) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds) and remove every socket this plugin created."""

    def readiness(self) -> Readiness:
        """Serving, and registered with kubelet where that applies."""

    async def reload(self, section: Any) -> None:
        """Apply a new, already validated section; a plugin that cannot reload in place restarts itself."""
