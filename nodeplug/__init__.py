"""nodeplug: one Kubernetes node agent serving a device plugin, a CSI driver and a CNI plugin.

``nodeplug.__version__`` is looked up on first use: reading package metadata costs milliseconds that the CNI entry
point's start-up path cannot spare.
"""

from __future__ import annotations

from functools import cache


@cache
def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nodeplug")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return version()
    raise AttributeError(f"module 'nodeplug' has no attribute {name!r}")
