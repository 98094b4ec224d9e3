"""tests/cluster/overlay stays an overlay of test-environment facts only: every image of the base replaced by a local
one that is never pulled, and the node's own CNI configuration directory. Anything else belongs in daemonset/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "daemonset"
OVERLAY = REPO / "tests" / "cluster" / "overlay"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_image_is_local_and_never_pulled() -> None:
    kustomization = load(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["../../../daemonset"]
    local = {i["name"]: i for i in kustomization["images"]}
    ds = next(d for d in yaml.safe_load_all((BASE / "daemonset.yaml").read_text()) if d["kind"] == "DaemonSet")
    patch = load(OVERLAY / "daemonset-patch.yaml")["spec"]["template"]["spec"]
    never = {c["name"] for c in containers(patch) if c == {"name": c["name"], "imagePullPolicy": "Never"}}
    for c in containers(ds["spec"]["template"]["spec"]):
        name = c["image"].rsplit(":", 1)[0] if "/" in c["image"] else c["image"]
        assert local[name]["newName"].startswith("localhost/nodeplug-test/"), c["name"]
        assert c["name"] in never, f"{c['name']}: imagePullPolicy Never in the overlay"


def test_only_the_cni_configuration_directory_moves() -> None:
    patch = load(OVERLAY / "daemonset-patch.yaml")["spec"]["template"]["spec"]
    assert set(patch) == {"initContainers", "containers", "volumes"}
    assert [v["name"] for v in patch["volumes"]] == ["cni-conf"]
    assert patch["volumes"][0]["hostPath"]["path"] == "/run/nodeplug-cluster/cni/net.d"
