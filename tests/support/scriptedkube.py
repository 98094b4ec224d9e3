"""A real :class:`nodeplug.kube.KubeClient` whose API server is a script in this process (httpx2's MockTransport):
for the client's own logic and for what the agent does when the API answers a given way, where a real
kube-apiserver cannot be made to answer that way (or need not run)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx2

if TYPE_CHECKING:
    from nodeplug.kube import KubeClient

SERVER = "https://10.0.0.1:6443"  # never dialled: every request goes to the script
KUBECONFIG = (
    "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
    f'clusters: [{{name: c, cluster: {{server: "{SERVER}", insecure-skip-tls-verify: true}}}}]\n'
    "users: [{name: u, user: {token: abc}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
)


def kubeconfig(directory: Path | None = None) -> Path:
    """A kubeconfig naming :data:`SERVER`, written into ``directory`` (a new temporary one by default)."""
    path = Path(directory or tempfile.mkdtemp(prefix="kc-")) / "kubeconfig"
    path.write_text(KUBECONFIG)
    return path


def scripted_client(answer: Callable[[httpx2.Request], httpx2.Response], directory: Path | None = None) -> KubeClient:
    """A client whose every request is answered by ``answer``."""
    from nodeplug.kube import KubeClient, resolve

    src = resolve(kubeconfig(directory), env={})
    assert src is not None
    return KubeClient(src, transport=httpx2.MockTransport(answer))
