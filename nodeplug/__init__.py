"""nodeplug: one Kubernetes node agent serving a device plugin, a CSI driver and a CNI plugin."""

from importlib import metadata

try:
    __version__ = metadata.version("nodeplug")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
