"""What the tests that run containers with podman (Debian's 4.3, CNI backend) need on the machine."""

from __future__ import annotations

import os
import shutil

import pytest

_TOOLS = {
    "podman": "podman",
    "runc": "runc",
    "nsenter": "util-linux",
    "busybox": "busybox-static",  # the containers' root filesystem
}

needs_podman = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: podman creates network namespaces and veths"),
    *(
        pytest.mark.skipif(shutil.which(tool) is None, reason=f"{tool} is not installed (Debian package {package})")
        for tool, package in _TOOLS.items()
    ),
]
