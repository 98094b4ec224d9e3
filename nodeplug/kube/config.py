"""Where the agent finds the Kubernetes API: a kubeconfig file, or the pod's service account, or nowhere.

In order, the first that applies wins:

1. ``nodeplug agent --kubeconfig FILE`` (development, or a node set up by hand);
2. the ``KUBECONFIG`` environment variable (its first file when it lists several);
3. in-cluster: ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` set and the service account's token mounted at
   ``/var/run/secrets/kubernetes.io/serviceaccount`` (the DaemonSet). The token file is read again when the API server
   answers 401, so kubelet's rotation of the projected token is followed;
4. none: :func:`resolve` returns None and the agent runs single-node, exactly as without this package.

A source that is named but unusable (a missing or malformed file, a context that does not exist) is an error
(:class:`KubeConfigError`, naming the file and the problem): silently running single-node on a cluster would
hand every node the same pod subnet.

The node's name: ``--node-name``, else ``NODE_NAME`` (the DaemonSet sets it from ``spec.nodeName``), else the host
name, as kubelet registers it by default (lower case).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # lightkube (and httpx under it) is imported only when an API is named: single-node stays lean
    from lightkube.config.kubeconfig import SingleConfig

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """The Kubernetes API was named but cannot be used; the message says which source and why."""


@dataclass(frozen=True)
class KubeSource:
    """The resolved connection: lightkube's config plus where it came from (for logs and /readyz)."""

    config: SingleConfig
    origin: str  # "kubeconfig /path" | "in-cluster service account"

    @property
    def server(self) -> str:
        return str(self.config.cluster.server)


def _from_file(path: Path, origin: str, context: str | None) -> KubeSource:
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.core.exceptions import ConfigError as LightkubeConfigError

    if not path.is_file():
        raise KubeConfigError(f"{origin}: no such file")
    try:
        kc = KubeConfig.from_file(path)
    except (LightkubeConfigError, OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError) as e:
        raise KubeConfigError(f"{origin}: not a usable kubeconfig: {e}") from None
    try:
        single = kc.get(context_name=context)
    except (LightkubeConfigError, KeyError, ValueError) as e:
        raise KubeConfigError(f"{origin}: {e}") from None
    if single is None or single.cluster is None or not getattr(single.cluster, "server", None):
        where = f"context {context!r}" if context else "its current context"
        raise KubeConfigError(f"{origin}: {where} names no cluster server")
    return KubeSource(single, origin)


def _in_cluster(env: Mapping[str, str], account_dir: Path) -> KubeSource | None:
    if not env.get("KUBERNETES_SERVICE_HOST") or not env.get("KUBERNETES_SERVICE_PORT"):
        return None
    token_file = account_dir / "token"
    if not token_file.exists():
        return None
    host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
    if ":" in host:
        host = f"[{host}]"
    try:
        token = token_file.read_text().strip()
        namespace = (account_dir / "namespace").read_text().strip()
    except OSError as e:
        raise KubeConfigError(f"in-cluster service account {account_dir}: {e}") from None
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.config.models import Cluster, User

    kc = KubeConfig.from_one(
        cluster=Cluster(server=f"https://{host}:{port}", certificate_auth=str(account_dir / "ca.crt")),
        user=User(token=token, token_file=str(token_file)),  # read again on 401: kubelet rotates it
        namespace=namespace,
    )
    single = kc.get()
    assert single is not None
    return KubeSource(single, f"in-cluster service account {account_dir}")


def resolve(
    kubeconfig: Path | None = None,
    env: Mapping[str, str] | None = None,
    context: str | None = None,
    account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeSource | None:
    """The API to follow, or None when none is configured (single-node mode); :class:`KubeConfigError` when the one
    named is unusable."""
    env = os.environ if env is None else env
    if kubeconfig is not None:
        return _from_file(kubeconfig, f"--kubeconfig {kubeconfig}", context)
    listed = env.get("KUBECONFIG", "")
    first = next((p for p in listed.split(os.pathsep) if p), "")
    if first:
        return _from_file(Path(first), f"KUBECONFIG {first}", context)
    return _in_cluster(env, account_dir)


def node_name(flag: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """This node's name as the API server knows it."""
    env = os.environ if env is None else env
    name = flag or env.get("NODE_NAME") or socket.gethostname()
    return name.strip().lower()
