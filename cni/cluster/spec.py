"""The cluster network as the agent shell knows it: the ``cluster_network`` section, built only when the agent
follows a Kubernetes API. Imports only its config; the service's code loads when it starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cni.cluster.config import ClusterConfig
from nodeplug.plugin import AgentContext, Plugin, PluginSpec

if TYPE_CHECKING:
    from nodeplug.checks import Check
    from nodeplug.config import AgentConfig


def _of(cfg: AgentConfig) -> ClusterConfig:
    return cfg.cluster_network


def _create(section: ClusterConfig, ctx: AgentContext) -> Plugin[ClusterConfig]:
    from cni.cluster.plugin import ClusterNetworkPlugin

    return ClusterNetworkPlugin(section, ctx)


def _checks(section: ClusterConfig, ctx: AgentContext) -> list[Check]:
    from cni.cluster.doctor import checks

    return checks(section, ctx)


SPEC = PluginSpec(
    name="cluster_network", section=ClusterConfig, of=_of, create=_create, checks=_checks, needs_kube=True
)
