"""The host as tests see it: the repository, root or not, and running a set-up command."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: creates netns, veth, loop devices or mounts")


def sh(*argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
    """Run a command for test set-up (argument list, no shell); raise with its stderr on failure."""
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def unique(prefix: str, n: int = 6) -> str:
    """A name unlikely to clash: ``prefix`` + random hex (keep interface names within 15 characters)."""
    return prefix + secrets.token_hex(n // 2 + 1)[:n]
