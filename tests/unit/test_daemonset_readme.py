"""daemonset/README.md stays true: its ``nodeplug`` command lines parse, and its example objects validate and name
what the base deploys (storage class, driver, device resources, network)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeplug import cli
from nodeplug.config import parse

REPO = Path(__file__).resolve().parents[2]
README = REPO / "daemonset" / "README.md"
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def nodeplug_commands() -> list[list[str]]:
    cmds = []
    for body in blocks("sh"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "nodeplug" in words and words[0] != "docker":
                cmds.append(words[words.index("nodeplug") :])
    return cmds


def examples() -> list[dict[str, Any]]:
    return [d for body in blocks("yaml") for d in yaml.safe_load_all(body) if d and "apiVersion" in d]


def test_every_nodeplug_command_in_the_readme_parses() -> None:
    cmds = nodeplug_commands()
    assert {c[1] for c in cmds} >= {"doctor", "install-cni"}
    for argv in cmds:
        try:
            cli.build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"README: nodeplug rejects {shlex.join(argv)}")


def test_the_readme_examples_validate_and_name_what_is_deployed() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="dev dependency kubernetes-validate is not installed")
    classes = {d["metadata"]["name"] for d in yaml.safe_load_all((REPO / "daemonset/storageclasses.yaml").read_text())}
    agent = parse(yaml.safe_load((REPO / "daemonset/agent.yaml").read_text()))
    resources = {f"nodeplug.io/{r.name}" for r in agent.deviceplugin.resources}
    seen = set()
    for obj in examples():
        kind = obj["kind"]
        seen.add(kind)
        if kind == "NetworkAttachmentDefinition":
            conf = json.loads(obj["spec"]["config"])
            assert conf["plugins"][0]["type"] == "nodeplug"
            continue
        kv.validate(obj, "1.35.0", strict=True)
        if kind == "PersistentVolumeClaim":
            assert obj["spec"]["storageClassName"] in classes
        if kind == "Pod":
            for c in obj["spec"]["containers"]:
                for name in c.get("resources", {}).get("limits", {}):
                    assert name in resources, f"{name} is not a resource the agent config advertises"
    assert {"Pod", "PersistentVolumeClaim", "NetworkAttachmentDefinition"} <= seen
    inline = re.search(r"csi: \{driver: ([\w.]+)", README.read_text())
    assert inline is not None and inline.group(1) == agent.csi.driver_name
