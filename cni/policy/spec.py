"""Network policy as the agent shell knows it: the ``network_policy`` section, built only when the agent follows a
Kubernetes API and its CNI is on. Imports only its config; the service's code loads when it starts or ``nodeplug
doctor`` checks it."""

from __future__ import annotations

from cni.policy.config import PolicyConfig
from nodeplug.plugin import Implementation, PluginSpec


def _load() -> Implementation[PolicyConfig]:
    from cni.policy import doctor, plugin

    return Implementation(plugin.NetworkPolicyPlugin, doctor.checks)


SPEC = PluginSpec(
    name="network_policy", section=PolicyConfig, of=lambda cfg: cfg.network_policy, load=_load, needs_kube=True,
    needs=("cni",),  # it enforces on the pods nodeplug's CNI attaches; without them it has nothing to do
)  # fmt: skip
