"""The host as tests see it: the repository, root or not, and running a set-up command (:mod:`lab.host`)."""

from __future__ import annotations

import os

import pytest

from lab.host import REPO, sh, unique

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: creates netns, veth, loop devices or mounts")

__all__ = ["IS_ROOT", "REPO", "needs_root", "sh", "unique"]
