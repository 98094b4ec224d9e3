"""A plugin that needs another section runs only where that section is on, and ``nodeplug doctor`` checks only
what the agent would run: network policy acts on the pods nodeplug's CNI attaches."""

from __future__ import annotations

from nodeplug.config import parse
from nodeplug.doctor import all_checks
from nodeplug.plugin import AgentContext
from nodeplug.plugins import PLUGINS


def _policy_groups(cni_on: bool) -> set[str]:
    cfg = parse({"cni": {"enabled": cni_on}, "network_policy": {"enabled": True}})
    return {c.group for c in all_checks(cfg, AgentContext())} & {"network_policy"}


def test_doctor_checks_network_policy_only_with_the_cni_on() -> None:
    assert _policy_groups(cni_on=True) == {"network_policy"}
    assert _policy_groups(cni_on=False) == set()


def test_network_policy_needs_the_cni() -> None:
    spec = next(s for s in PLUGINS if s.name == "network_policy")
    assert spec.needs_off(parse({"cni": {"enabled": False}})) == ["cni"]
    assert spec.needs_off(parse({})) == []
    assert not spec.wanted(parse({"cni": {"enabled": False}}), AgentContext())
