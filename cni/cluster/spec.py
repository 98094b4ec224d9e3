"""The cluster network as the agent shell knows it: the ``cluster_network`` section, built only when the agent
follows a Kubernetes API. Imports only its config; the service's code loads when it starts or ``nodeplug doctor``
checks it."""

from __future__ import annotations

from cni.cluster.config import ClusterConfig
from nodeplug.plugin import Implementation, PluginSpec


def _load() -> Implementation[ClusterConfig]:
    from cni.cluster import doctor, plugin

    return Implementation(plugin.ClusterNetworkPlugin, doctor.checks)


SPEC = PluginSpec(
    name="cluster_network", section=ClusterConfig, of=lambda cfg: cfg.cluster_network, load=_load, needs_kube=True
)
