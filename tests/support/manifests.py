"""The DaemonSet's kustomize base, rendered by ``kubectl kustomize``, as fixtures (a pytest plugin registered in
tests/conftest.py): ``objs`` (every object), ``ds`` (the DaemonSet), ``pod`` (its pod spec) and ``agent_config`` (the
agent config its ConfigMap carries, parsed by the agent's own loader)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from nodeplug.config import AgentConfig, parse

BASE = Path(__file__).resolve().parents[2] / "daemonset"


def pod_specs(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        yield spec
    elif "template" in spec:
        yield spec["template"]["spec"]


def containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def render(kubectl: Path, base: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(kubectl), "kustomize", str(base)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {base} failed: {out.stderr.strip()}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@pytest.fixture(scope="module")
def objs(kubectl: Path) -> list[dict[str, Any]]:
    return render(kubectl, BASE)


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def ds(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "DaemonSet", "nodeplug")


@pytest.fixture(scope="module")
def pod(ds: dict[str, Any]) -> dict[str, Any]:
    return dict(ds["spec"]["template"]["spec"])


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in containers(pod) if c["name"] == name]
    assert found, f"no container {name}"
    return found[0]


@pytest.fixture(scope="module")
def agent_config(objs: list[dict[str, Any]], pod: dict[str, Any]) -> AgentConfig:
    agent = container(pod, "agent")
    config_arg = [a for a in agent["command"] if a.startswith("--config=")]
    assert config_arg, "the agent is started with --config=FILE"
    path = PurePosixPath(config_arg[0].split("=", 1)[1])
    mount = next(m for m in agent["volumeMounts"] if path.is_relative_to(m["mountPath"]))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = one(objs, "ConfigMap", vol["configMap"]["name"])
    key = str(path.relative_to(mount["mountPath"]))
    assert key in cm["data"], f"{path}: ConfigMap {cm['metadata']['name']} has no key {key}"
    return parse(yaml.safe_load(cm["data"][key]), f"ConfigMap {key}")
