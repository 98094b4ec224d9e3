"""A plugin's ``needs``: it runs only while the sections it needs are enabled (network policy acts on the pods
nodeplug's CNI attaches), and ``nodeplug doctor`` checks only what the agent would run."""

from __future__ import annotations

from typing import cast

from cni.policy.spec import SPEC as POLICY
from nodeplug.config import AgentConfig
from nodeplug.doctor import all_checks
from nodeplug.kube import KubeClient
from nodeplug.plugin import AgentContext

# disabled_reason only asks whether the agent follows an API; nothing is called on the client
WITH_API = AgentContext(kube=cast(KubeClient, object()), node_name="n1")


def config(cni: bool) -> AgentConfig:
    return AgentConfig.model_validate({"cni": {"enabled": cni}, "network_policy": {"enabled": True}})


def test_network_policy_runs_with_the_cni_on() -> None:
    assert POLICY.disabled_reason(config(cni=True), WITH_API) == ""
    assert POLICY.wanted(config(cni=True), WITH_API)


def test_network_policy_is_off_with_the_cni_off_and_says_why() -> None:
    reason = POLICY.disabled_reason(config(cni=False), WITH_API)
    assert reason == "it needs cni, which the config turns off (cni.enabled)"
    assert not POLICY.wanted(config(cni=False), WITH_API)


def test_the_missing_api_is_named_before_the_missing_section() -> None:
    assert "no Kubernetes API" in POLICY.disabled_reason(config(cni=False), AgentContext())


def test_doctor_checks_network_policy_only_with_the_cni_on() -> None:
    def groups(cni: bool) -> set[str]:
        return {c.group for c in all_checks(config(cni), AgentContext())} & {"network_policy"}

    assert groups(cni=True) == {"network_policy"}
    assert groups(cni=False) == set()
