"""A plugin that runs one service following the Kubernetes API (the cluster network, network policy).

:class:`ServicePlugin` is the part such plugins share: the service :meth:`ServicePlugin.build` makes runs while the
plugin runs, the plugin's own collectors are on the agent's registry from its start to its stop, ``/readyz`` shows
the service's readiness, and a changed section restarts the service. Without an API there is nothing to follow: the
spec says ``needs_kube``, so the shell does not start it, and a start without one fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from nodeplug.plugin import AgentContext, Readiness, S

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from nodeplug.kube import KubeClient


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def readiness(self) -> tuple[bool, str]:
        """(ready, detail) for ``/readyz``."""


V = TypeVar("V", bound=Service)


class ServicePlugin(Generic[S, V]):
    """``name`` is the section's; ``what`` names the plugin in its log lines and errors ("network policy")."""

    name: str
    what: str

    def __init__(self, section: S, ctx: AgentContext, collectors: Sequence[Collector]) -> None:
        self.section = section
        self.ctx = ctx
        self.log = ctx.logger(self.name)
        self.service: V | None = None
        self._collectors = collectors
        self._attached = False

    def build(self, kube: KubeClient) -> V:
        """The service for :attr:`section`, not started yet."""
        raise NotImplementedError

    async def start(self) -> None:
        kube = self.ctx.kube
        if kube is None:
            raise RuntimeError(f"{self.what} needs a Kubernetes API (--kubeconfig, KUBECONFIG or in-cluster)")
        if not self._attached:
            for c in self._collectors:
                self.ctx.metrics.registry.register(c)
            self._attached = True
        self.service = self.build(kube)
        await self.service.start()

    async def stop(self, grace: float) -> None:
        service, self.service = self.service, None
        if service is not None:
            await service.stop()
        if self._attached:
            for c in self._collectors:
                self.ctx.metrics.registry.unregister(c)
            self._attached = False

    def readiness(self) -> Readiness:
        if self.service is None:
            return Readiness(False, "not started")
        ready, detail = self.service.readiness()
        return Readiness(ready, detail)

    async def reload(self, section: S) -> None:
        self.log.info(f"restarting {self.what} for the new config")
        await self.stop(0)
        self.section = section
        await self.start()
