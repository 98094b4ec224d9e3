"""The Kubernetes binaries of ``KUBE_ASSETS``, through the one cache scripts/cluster-up uses.

The implementation is ``scripts/cluster/kubecache.py`` (content-keyed, safe when several processes unpack at once),
loaded here by its path: and the tests' own package ``cluster``
(tests/cluster) would shadow ``scripts/cluster`` on the import path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lab.host import REPO


def _load_kubecache() -> object:
    spec = importlib.util.spec_from_file_location("nodeplug_kubecache", REPO / "scripts" / "cluster" / "kubecache.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kubecache: object = _load_kubecache()


def kube_assets() -> Path:
    """$KUBE_ASSETS, the folder of xz-compressed Kubernetes binaries; by default ../shared/kube beside the repository
    (a relative value is taken from the repository too)."""
    folder: Path = kubecache.assets_dir()  # type: ignore[attr-defined]
    return folder


# Every reason :func:`absent` gives ends with this; the tests' end-of-run summary counts the skips that carry it.
ABSENT = "set KUBE_ASSETS to the folder holding the Kubernetes binaries"


def absent(*names: str) -> str:
    """Why some of ``names`` cannot be had ("" when every ``NAME.xz`` is in :func:`kube_assets`)."""
    missing = [n for n in names if not (kube_assets() / f"{n}.xz").is_file()]
    if not missing:
        return ""
    listed = ", ".join(f"{n}.xz" for n in missing)
    return f"{kube_assets()} lacks {listed}: {ABSENT}"


def binary(name: str) -> Path:
    """The binary ``name`` unpacked into the shared cache (once per content of ``name.xz``)."""
    out: Path = kubecache.unpack(kube_assets() / f"{name}.xz")  # type: ignore[attr-defined]
    return out
