"""The cluster network as the agent runs it: one :class:`~cni.cluster.network.ClusterNetwork` service, its
metrics on the agent's registry, its readiness in ``/readyz``.

It runs only when the agent follows a Kubernetes API (the spec says so: without one the shell does not start it).
Not ready while this node has no pod subnet to hand out (no podCIDR on its Node, or the Node unknown), while an
uninstall has removed it, or while another process holds its lock. A changed ``cluster_network`` section restarts
the service; stopping it leaves the kernel as it is (routes keep carrying traffic while the agent restarts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cni.cluster import uninstall
from cni.cluster.config import ClusterConfig
from cni.cluster.findings import Metrics
from cni.cluster.network import ClusterNetwork
from nodeplug.plugin import AgentContext
from nodeplug.serviceplugin import ServicePlugin

if TYPE_CHECKING:
    from nodeplug.kube import KubeClient


class ClusterNetworkPlugin(ServicePlugin[ClusterConfig, ClusterNetwork]):
    name = "cluster_network"
    what = "the cluster network"

    def __init__(self, section: ClusterConfig, ctx: AgentContext) -> None:
        self.metrics = Metrics()
        super().__init__(section, ctx, self.metrics.collectors())

    def build(self, kube: KubeClient) -> ClusterNetwork:
        root = self.ctx.root
        return ClusterNetwork(
            self.section, kube, self.ctx.node_name, root(self.section.subnets_file), self.log, self.metrics,
            root(uninstall.LOCK), root(uninstall.MARKER), events=self.ctx.events, health=self.ctx.api_health,
        )  # fmt: skip
