"""``deviceplugin.dra.enabled: auto`` (pure): DRA on where the API server serves resource.k8s.io and this node's
kubelet registers the driver, off as soon as either says it has none, undecided otherwise; kubelet's refusal text is
parsed, so it is tried with any text. The config key takes exactly auto, true and false."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplugin.dra.auto import Answer, api_answer, decide, kubelet_answer, takes_no_dra
from nodeplug.config import ConfigError, parse

# what kubelet 1.32's plugin manager sends a plugin whose type it has no handler for (DRA feature gate off)
NO_HANDLER = (
    "RegisterPlugin error -- no handler registered for plugin type: DRAPlugin at socket "
    "/var/lib/kubelet/plugins_registry/devices.nodeplug.io-reg.sock"
)
SERVED = api_answer("v1beta1")
REGISTERED = kubelet_answer(True, "")


def test_on_only_when_both_have_it() -> None:
    d = decide(SERVED, REGISTERED)
    assert d.on is True
    assert d.describe() == ("DRA on: the API server serves resource.k8s.io/v1beta1; kubelet registered the DRA plugin")


def test_off_when_the_api_server_serves_no_version() -> None:
    refusal = "the API server does not serve resource.k8s.io: enable DynamicResourceAllocation"
    for kubelet in (REGISTERED, kubelet_answer(None, ""), kubelet_answer(False, NO_HANDLER)):
        d = decide(api_answer("", refusal), kubelet)
        assert (d.on, d.reason) == (False, refusal)  # the API server's answer is named first


def test_off_when_kubelet_has_no_handler_for_dra() -> None:
    d = decide(SERVED, kubelet_answer(False, NO_HANDLER))
    assert d.on is False
    assert d.describe().startswith("DRA off: this node's kubelet takes no DRA plugins")
    assert NO_HANDLER in d.reason
    # the same without the API server's answer yet: kubelet's no is enough
    assert decide(api_answer(""), kubelet_answer(False, NO_HANDLER)).on is False


@pytest.mark.parametrize(
    ("api", "kubelet", "waiting_for"),
    [
        (api_answer(""), REGISTERED, "waiting for the API server's discovery of resource.k8s.io"),
        (SERVED, kubelet_answer(None, ""), "waiting for kubelet's plugin watcher to register the DRA plugin"),
        (SERVED, kubelet_answer(None, "", called=True), "registration outcome not reported yet"),
        # another refusal is a problem to report, not an answer
        (SERVED, kubelet_answer(False, "plugin name already registered"), "kubelet rejected the DRA plugin"),
        (SERVED, kubelet_answer(False, ""), "kubelet rejected the DRA plugin: no reason given"),
    ],
)
def test_undecided_until_both_answer(api: Answer, kubelet: Answer, waiting_for: str) -> None:
    d = decide(api, kubelet)
    assert d.on is None and waiting_for in d.reason


def test_the_refusals_kubelet_sends() -> None:
    assert takes_no_dra(NO_HANDLER)
    assert takes_no_dra("no handler registered for plugin type: DRAPlugin at socket /x")  # before the prefix
    assert not takes_no_dra(NO_HANDLER.replace("DRAPlugin", "CSIPlugin"))
    assert not takes_no_dra(NO_HANDLER.replace("DRAPlugin", "DRAPluginX"))
    assert not takes_no_dra("")


@given(st.text(), st.text())
def test_any_refusal_text(before: str, after: str) -> None:
    """kubelet's text comes over the socket: any text is an answer or an undecided refusal, never an error; it is
    "no DRA" exactly when it carries kubelet's no-handler sentence for DRAPlugin, wherever that stands."""
    text = before + after
    says = kubelet_answer(False, text).says
    assert says is (False if takes_no_dra(text) else None)
    if "no handler registered" not in text:
        assert says is None
    if "no handler registered" not in before:
        sentence = f"{before}no handler registered for plugin type: DRAPlugin at socket {after}"
        assert kubelet_answer(False, sentence).says is False


@pytest.mark.parametrize("value", ["auto", True, False])
def test_enabled_takes_auto_true_false(value: object) -> None:
    cfg = parse({"deviceplugin": {"dra": {"enabled": value}}})
    assert cfg.deviceplugin.dra.enabled == value


def test_enabled_defaults_to_auto() -> None:
    assert parse({}).deviceplugin.dra.enabled == "auto"


@pytest.mark.parametrize("value", ["yes", "on", 1, "maybe", None])
def test_enabled_refuses_anything_else(value: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse({"deviceplugin": {"dra": {"enabled": value}}})
    assert all(p.startswith("deviceplugin.dra.enabled") for p in e.value.problems), e.value.problems


def test_offering_through_dra_needs_dra_not_off() -> None:
    shared = {"name": "fuse", "devices": ["/dev/fuse"], "replicas": 4, "offer": "both"}
    assert parse({"deviceplugin": {"resources": [shared]}}).deviceplugin.resources[0].offer == "both"
    with pytest.raises(ConfigError) as e:
        parse({"deviceplugin": {"resources": [shared], "dra": {"enabled": False}}})
    assert "set dra.enabled: auto or true" in str(e.value.problems)
    # replicas through DRA alone: that many devices in the slice
    only = {**shared, "offer": "dra"}
    assert parse({"deviceplugin": {"resources": [only]}}).deviceplugin.resources[0].replicas == 4
