"""The binaries of KUBE_ASSETS (xz-compressed), unpacked once into the cache, keyed by their content."""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
from pathlib import Path

from cluster.common import CACHE, KUBE_ASSETS, ClusterError

BINARIES = [
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl",
    "containerd", "containerd-shim-runc-v2", "ctr", "crictl",
    "csi-provisioner", "csi-resizer", "csi-snapshotter", "snapshot-controller",
]  # fmt: skip


def missing() -> list[str]:
    """The compressed binaries KUBE_ASSETS lacks (empty when the cluster can run)."""
    return [f"{b}.xz" for b in BINARIES if not (KUBE_ASSETS / f"{b}.xz").is_file()]


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def binary(name: str) -> Path:
    """``name`` unpacked to ``CACHE/bin/<sha256 of name.xz>/name`` (done once; concurrent callers are safe)."""
    src = KUBE_ASSETS / f"{name}.xz"
    if not src.is_file():
        raise ClusterError(f"{src}: missing (set KUBE_ASSETS to the directory of the Kubernetes binaries)")
    out = CACHE / "bin" / digest(src)[:16] / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{name}.{os.getpid()}")
    with lzma.open(src) as f, open(tmp, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)
    tmp.chmod(0o755)
    os.replace(tmp, out)
    return out


def all_binaries() -> dict[str, Path]:
    return {b: binary(b) for b in BINARIES}
