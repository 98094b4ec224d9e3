"""Host paths under a configurable root.

Every path nodeplug touches has a well-known absolute default (the README lists them). The agent places all of them
under one ``root`` (default ``/``), so tests and the demo run the whole agent in a temporary directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = DEVICE_PLUGIN_DIR + "/kubelet.sock"
KUBELET_DIR = "/var/lib/kubelet"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
PLUGINS_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
STATE_DIR = "/var/lib/nodeplug"
RUN_DIR = "/run/nodeplug"
CNI_SOCKET = RUN_DIR + "/cni.sock"
CDI_DIR = "/var/run/cdi"
CNI_BIN_DIR = "/opt/cni/bin"
CNI_CONF_DIR = "/etc/cni/net.d"


@dataclass(frozen=True)
class Root:
    """Maps default absolute paths under the agent's root directory."""

    path: Path = Path("/")

    def __call__(self, default: str | Path) -> Path:
        """``root("/run/nodeplug")`` -> ``<root>/run/nodeplug``; the default must be absolute."""
        p = Path(default)
        if not p.is_absolute():
            raise ValueError(f"expected an absolute default path, got {str(default)!r}")
        if self.path == Path("/"):
            return p
        return self.path / p.relative_to("/")
