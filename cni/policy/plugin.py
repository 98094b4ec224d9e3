"""Network policy as the agent runs it: one :class:`~cni.policy.service.PolicyService`, its metrics on the agent's
registry, its readiness in ``/readyz``, and its side of CNI ADD and DEL (:class:`Attachments`, registered in the
agent context for the CNI server while it runs).

A changed ``network_policy`` section restarts the service; stopping it leaves the kernel's tables as they are (the
rules keep enforcing while the agent restarts), and while it is stopped the CNI server quarantines what it hands out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from cni.errors import DATAPLANE, CniError
from cni.policy import quarantine
from cni.policy.config import PolicyConfig
from cni.policy.service import Metrics, PolicyService
from nodeplug.plugin import AgentContext
from nodeplug.serviceplugin import ServicePlugin

if TYPE_CHECKING:
    from nodeplug.kube import KubeClient


class Attachments:
    """The CNI server's calls (on its worker threads), run on the service's event loop; whatever goes wrong or takes
    too long, the addresses end up quarantined, never open."""

    def __init__(self, service: PolicyService, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.service, self.loop, self.timeout = service, loop, timeout

    def added(self, namespace: str, name: str, uid: str, ips: Sequence[str]) -> None:
        if not ips or not namespace or not name:  # not a Kubernetes pod (no K8S_POD_*): no policy names it
            return
        self._run(self.service.attach(namespace, name, uid, list(ips)), ips)

    def freed(self, ips: Sequence[str]) -> None:
        if ips:
            self._run(self.service.detach(list(ips)), ips)

    def _run(self, coro: Coroutine[Any, Any, object], ips: Sequence[str]) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            fut.result(self.timeout + 5)
            return
        except (concurrent.futures.TimeoutError, Exception):
            fut.cancel()
        try:
            quarantine.hold(ips)
        except quarantine.QuarantineError as e:
            raise CniError(DATAPLANE, details=f"network policy: {e}") from None


class NetworkPolicyPlugin(ServicePlugin[PolicyConfig, PolicyService]):
    name = "network_policy"
    what = "network policy"

    def __init__(self, section: PolicyConfig, ctx: AgentContext) -> None:
        self.metrics = Metrics()
        super().__init__(section, ctx, self.metrics.collectors())
        self.hook: Attachments | None = None

    def build(self, kube: KubeClient) -> PolicyService:
        from cni.cluster import uninstall

        marker = self.ctx.root(uninstall.MARKER)
        return PolicyService(self.section, kube, self.ctx.node_name, self.log, self.metrics, marker)

    async def start(self) -> None:
        await super().start()
        assert self.service is not None
        self.hook = Attachments(self.service, asyncio.get_running_loop(), self.section.attach_timeout_seconds)
        self.ctx.pod_addresses.append(self.hook)

    async def stop(self, grace: float) -> None:
        if self.hook is not None and self.hook in self.ctx.pod_addresses:
            self.ctx.pod_addresses.remove(self.hook)
        self.hook = None
        await super().stop(grace)
