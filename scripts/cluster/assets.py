"""The binaries of KUBE_ASSETS (xz-compressed), unpacked once into the cache, keyed by their content (kubecache)."""

from __future__ import annotations

from pathlib import Path

from cluster.common import CACHE, KUBE_ASSETS, ClusterError
from cluster.kubecache import unpack

BINARIES = [
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "kube-proxy",
    "containerd", "containerd-shim-runc-v2", "ctr", "crictl",
    "csi-provisioner", "csi-resizer", "csi-snapshotter", "snapshot-controller",
]  # fmt: skip


def missing() -> list[str]:
    """The compressed binaries KUBE_ASSETS lacks (empty when the cluster can run)."""
    return [f"{b}.xz" for b in BINARIES if not (KUBE_ASSETS / f"{b}.xz").is_file()]


def binary(name: str) -> Path:
    """``name`` unpacked to ``CACHE/bin/<sha256 of name.xz>/name`` (done once; concurrent callers are safe)."""
    src = KUBE_ASSETS / f"{name}.xz"
    if not src.is_file():
        raise ClusterError(f"{src}: missing (set KUBE_ASSETS to the directory of the Kubernetes binaries)")
    return unpack(src, CACHE)


def all_binaries() -> dict[str, Path]:
    return {b: binary(b) for b in BINARIES}
