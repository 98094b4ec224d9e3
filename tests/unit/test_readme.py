"""The README's examples are real: its agent config validates and its network config parses."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from cni.netconf import parse_bridge
from nodeplug.config import AgentConfig, parse

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_agent_config_is_valid_and_shows_the_defaults() -> None:
    text = blocks("yaml")[0]
    cfg = parse(yaml.safe_load(text), "README")
    defaults = AgentConfig()
    for field in ("root", "log_level", "http", "shutdown_grace_seconds", "cni"):
        assert getattr(cfg, field) == getattr(defaults, field), field
    csi = cfg.csi.model_dump()
    assert csi == defaults.csi.model_dump()
    dp = cfg.deviceplugin
    assert [r.name for r in dp.resources][:2] == [r.name for r in defaults.deviceplugin.resources]
    assert dp.model_dump(exclude={"resources"}) == defaults.deviceplugin.model_dump(exclude={"resources"})


def _keys_not_shown(model: type[BaseModel], shown: list[dict[str, Any]], where: str) -> list[str]:
    """Fields of ``model`` (and of the models inside it) that none of the ``shown`` mappings sets."""
    missing = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        values = [d[key] for d in shown if key in d]
        if not values:
            missing.append(where + key)
            continue
        for inner in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                items = [v for value in values for v in (value if isinstance(value, list) else [value])]
                missing += _keys_not_shown(inner, [v for v in items if isinstance(v, dict)], f"{where}{key}.")
    return missing


def test_readme_agent_config_shows_every_key() -> None:
    """Every key of the config models, nested ones and a resource's, appears in the README's config block."""
    (text, *_) = blocks("yaml")
    assert _keys_not_shown(AgentConfig, [yaml.safe_load(text)], "") == []


def test_readme_network_config_parses() -> None:
    (text,) = blocks("json")
    conflist = json.loads(text)
    plugin = conflist["plugins"][0]
    assert plugin["type"] == "nodeplug"
    # as a runtime hands it to the plugin: the list's name and cniVersion injected
    conf = parse_bridge({**plugin, "name": conflist["name"], "cniVersion": conflist["cniVersion"]})
    assert conf.bridge == "nodeplug0" and conf.ip_masq and conf.socket == "/run/nodeplug/cni.sock"


def test_readme_dra_example_is_valid_and_uses_a_shipped_device_class() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    (text,) = blocks("k8s")
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["ResourceClaimTemplate", "Pod"]
    for d in docs:
        kv.validate(d, "1.33.0", strict=True)
    shipped = {
        d["metadata"]["name"]
        for d in yaml.safe_load_all((README.parent / "daemonset" / "dra.yaml").read_text())
        if d and d["kind"] == "DeviceClass"
    }
    (request,) = docs[0]["spec"]["spec"]["devices"]["requests"]
    assert request["deviceClassName"] in shipped
    pod = docs[1]["spec"]
    assert pod["resourceClaims"][0]["resourceClaimTemplateName"] == docs[0]["metadata"]["name"]
    assert pod["containers"][0]["resources"]["claims"][0]["name"] == pod["resourceClaims"][0]["name"]
