"""A single-node agent (no API named) never loads the Kubernetes client: lightkube and httpx cost several MiB of
every agent's memory, and only an agent following an API needs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.host import REPO


def _run(code: str) -> list[object]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
    return list(json.loads(out.stdout))


def test_the_plugins_and_resolving_no_api_leave_lightkube_unloaded(tmp_path: Path) -> None:
    code = f"""
import json, sys
import nodeplug.cli, nodeplug.agent, deviceplugin.plugin, csi.plugin, cni.plugin
from nodeplug.kube.config import resolve
source = resolve(None, env={{}}, account_dir=__import__("pathlib").Path({str(tmp_path)!r}))
loaded = {{m.split(".")[0] for m in sys.modules}}
print(json.dumps([source is None, sorted(loaded & {{"lightkube", "httpx", "httpx2"}})]))
"""
    assert _run(code) == [True, []]


def test_the_package_names_load_on_first_use_and_are_the_modules_own(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    code = f"""
import json, sys
import nodeplug.kube as kube
from nodeplug.kube import client, config, watch
source = kube.resolve(__import__("pathlib").Path({str(kubeconfig)!r}))
same = [kube.KubeClient is client.KubeClient, kube.ListWatch is watch.ListWatch, kube.KubeSource is config.KubeSource]
try:
    kube.NoSuchName
    missing = False
except AttributeError:
    missing = True
print(json.dumps([source.server, same, missing, "lightkube" in sys.modules]))
"""
    assert _run(code) == ["https://127.0.0.1:6443", [True, True, True], True, True]
