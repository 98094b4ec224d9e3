"""Network policy as the agent shell knows it: the ``network_policy`` section, built only when the agent follows a
Kubernetes API and its CNI is on. Imports only its config; the service's code loads when it starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cni.policy.config import PolicyConfig
from nodeplug.plugin import AgentContext, Plugin, PluginSpec

if TYPE_CHECKING:
    from nodeplug.checks import Check
    from nodeplug.config import AgentConfig


def _of(cfg: AgentConfig) -> PolicyConfig:
    return cfg.network_policy


def _create(section: PolicyConfig, ctx: AgentContext) -> Plugin[PolicyConfig]:
    from cni.policy.plugin import NetworkPolicyPlugin

    return NetworkPolicyPlugin(section, ctx)


def _checks(section: PolicyConfig, ctx: AgentContext) -> list[Check]:
    from cni.policy.doctor import checks

    return checks(section, ctx)


SPEC = PluginSpec(
    name="network_policy", section=PolicyConfig, of=_of, create=_create, checks=_checks, needs_kube=True,
    needs=("cni",),  # it enforces on the pods nodeplug's CNI attaches; without them it has nothing to do
)  # fmt: skip
