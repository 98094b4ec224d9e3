"""A host root for ``nodeplug install-cni`` in a temporary directory, and what a stand-in bundle answers."""

from __future__ import annotations

from pathlib import Path

VERSION_REPLY = '{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0","1.1.0"]}'  # a stand-in's VERSION


def cni_host(root: Path) -> Path:
    """``root`` made a host with the runtime's CNI directories (``/opt/cni/bin``, ``/etc/cni/net.d``), empty."""
    (root / "opt/cni/bin").mkdir(parents=True)
    (root / "etc/cni/net.d").mkdir(parents=True)
    return root
