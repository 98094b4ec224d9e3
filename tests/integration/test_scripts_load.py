"""The benchmark and runner scripts under scripts/ load and describe themselves: each imports the project's modules
by name (nothing in the test suite imports a script), so a module renamed or a name moved breaks a script only
here, and ``--help`` is where an operator meets it first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.host import REPO

SCRIPTS = sorted(
    p.name
    for p in (REPO / "scripts").iterdir()
    if p.is_file()
    and p.name.startswith(("bench-", "build-", "conformance"))
    and "python" in p.read_text().split("\n")[0]
)


def test_every_python_script_is_here() -> None:
    assert {"bench-cluster-network", "bench-cni", "bench-netpol", "conformance"} <= set(SCRIPTS), SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_loads_and_prints_its_usage(name: str) -> None:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / name), "--help"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith((f"usage: {name} ", f"usage: scripts/{name} ")), out.stdout[:300]
