"""daemonset/monitoring/: the PrometheusRule's rule groups checked and unit-tested by Prometheus's own promtool
(``promtool check rules``, ``promtool test rules`` with the cases in tests/integration/monitoring/), every metric the
rules read registered by the agent's code, and the component rendered over the base by ``kubectl kustomize``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.manifests import render

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "daemonset" / "monitoring"
CASES = Path(__file__).parent / "monitoring"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package)")


def rule_groups() -> dict[str, Any]:
    """The rules file Prometheus would load: the PrometheusRule's spec (what the Operator hands it)."""
    doc = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    return dict(doc["spec"])


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups(), sort_keys=False))
    for case in CASES.glob("*.yaml"):
        shutil.copy(case, tmp_path / case.name)
    return tmp_path


@needs_promtool
def test_promtool_accepts_the_rules(rules_dir: Path) -> None:
    p = promtool("check", "rules", "rules.yaml", cwd=rules_dir)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout and "rules found" in p.stdout, p.stdout


@needs_promtool
def test_promtool_unit_tests_pass(rules_dir: Path) -> None:
    p = promtool("test", "rules", *sorted(c.name for c in CASES.glob("*.yaml")), cwd=rules_dir)
    assert p.returncode == 0, p.stdout + p.stderr


@needs_promtool
def test_the_unit_tests_can_fail(rules_dir: Path) -> None:
    """A rule changed under the cases (the device plugin's alert made to wait longer) is caught."""
    groups = rule_groups()
    for group in groups["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "NodeplugDevicePluginNotRegistered":
                rule["for"] = "10m"
    (rules_dir / "rules.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    p = promtool("test", "rules", "alerts_test.yaml", cwd=rules_dir)
    assert p.returncode != 0 and "NodeplugDevicePluginNotRegistered" in p.stdout + p.stderr


def test_every_alert_has_a_case_and_every_metric_read_is_registered() -> None:
    groups = rule_groups()["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    cases = (CASES / "alerts_test.yaml").read_text()
    untested = sorted(a for a in alerts if f"alertname: {a}" not in cases)
    assert not untested, f"alerts without a promtool case: {untested}"
    for g in groups:
        for r in g["rules"]:
            assert "alert" not in r or {"summary", "description"} <= set(r["annotations"]), r["alert"]
            assert "alert" not in r or r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]

    read = {m for g in groups for r in g["rules"] for m in re.findall(r"\bnodeplug_[a-z_]+", r["expr"])}
    source = "\n".join(
        p.read_text() for d in ("nodeplug", "csi", "cni", "deviceplugin") for p in (REPO / d).rglob("*.py")
    )
    for metric in sorted(read):
        base = re.sub(r"_(total|bucket|count|sum)$", "", metric)
        assert f'"{base}"' in source, f"the rules read {metric}, which no collector in the code registers"


def test_the_component_renders_over_the_base(kubectl: Path, tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "daemonset", tmp_path)],
        "components": [os.path.relpath(MONITORING, tmp_path)],
    }))  # fmt: skip
    objs = render(kubectl, tmp_path)
    kinds = {(o["kind"], o["metadata"].get("namespace")) for o in objs}
    assert ("PodMonitor", "nodeplug-system") in kinds and ("PrometheusRule", "nodeplug-system") in kinds
    (pm,) = [o for o in objs if o["kind"] == "PodMonitor"]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    assert labels[pm["spec"]["jobLabel"]] == "nodeplug"  # the job the alerts select
    ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports
    # the base alone ships neither (they need the Prometheus Operator's CRDs)
    assert not [o for o in render(kubectl, REPO / "daemonset") if o["kind"] in ("PodMonitor", "PrometheusRule")]
