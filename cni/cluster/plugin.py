"""The cluster network as the agent runs it: one :class:`~cni.cluster.network.ClusterNetwork` service, its
metrics on the agent's registry, its readiness in ``/readyz``.

It runs only when the agent follows a Kubernetes API (the spec says so: without one the shell does not start it).
Not ready while this node has no pod subnet to hand out (no podCIDR on its Node, or the Node unknown), while an
uninstall has removed it, or while another process holds its lock. A changed ``cluster_network`` section restarts
the service; stopping it leaves the kernel as it is (routes keep carrying traffic while the agent restarts).
"""

from __future__ import annotations

from cni.cluster import uninstall
from cni.cluster.config import ClusterConfig
from cni.cluster.findings import Metrics
from cni.cluster.network import ClusterNetwork
from nodeplug.plugin import AgentContext, Readiness


class ClusterNetworkPlugin:
    name = "cluster_network"

    def __init__(self, section: ClusterConfig, ctx: AgentContext) -> None:
        self.section = section
        self.ctx = ctx
        self.log = ctx.logger(self.name)
        self.metrics = Metrics()
        self.service: ClusterNetwork | None = None
        self._attached = False

    async def start(self) -> None:
        kube = self.ctx.kube
        if kube is None:
            raise RuntimeError("the cluster network needs a Kubernetes API (--kubeconfig, KUBECONFIG or in-cluster)")
        if not self._attached:
            for c in self.metrics.collectors():
                self.ctx.metrics.registry.register(c)
            self._attached = True
        root = self.ctx.root
        self.service = ClusterNetwork(
            self.section, kube, self.ctx.node_name, root(self.section.subnets_file), self.log, self.metrics,
            root(uninstall.LOCK), root(uninstall.MARKER), events=self.ctx.events, health=self.ctx.api_health,
        )  # fmt: skip
        await self.service.start()

    async def stop(self, grace: float) -> None:
        service, self.service = self.service, None
        if service is not None:
            await service.stop()  # the kernel keeps its routes: a restarted agent finds them and leaves them be
        if self._attached:
            for c in self.metrics.collectors():
                self.ctx.metrics.registry.unregister(c)
            self._attached = False

    def readiness(self) -> Readiness:
        if self.service is None:
            return Readiness(False, "not started")
        ready, detail = self.service.readiness()
        return Readiness(ready, detail)

    async def reload(self, section: ClusterConfig) -> None:
        self.log.info("restarting the cluster network for the new config", mode=section.mode)
        service, self.service = self.service, None
        if service is not None:
            await service.stop()
        self.section = section
        self.service = None
        await self.start()
