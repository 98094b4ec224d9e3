"""The CNI bundle for the sources in the tree (``scripts/build-cni-bundle``), built once per change of its sources
into ``build/test-cni-bundle/<hash>``: what the install-cni tests install and what ``scripts/bench-cni`` execs."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "test-cni-bundle"
SOURCES = ["scripts/build-cni-bundle", "cni/launcher/launcher.c", "cni/launcher/fastpath.c", "cni/launcher/fastpath.h",
           "pyproject.toml"]  # fmt: skip
STATIC_LIBC = ("/usr/lib/x86_64-linux-gnu/libc.a", "/usr/lib/aarch64-linux-gnu/libc.a")
VENV_PYTHON = REPO / ".venv" / "bin" / "python"


def python() -> str:
    """The interpreter that builds it: the project's virtualenv (scripts/setup), where PyInstaller is, when there is
    one (a bench run as ``scripts/bench-cni`` runs under the system's python3)."""
    return str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def sources_hash() -> str:
    h = hashlib.sha256()
    files = [REPO / f for f in SOURCES]
    for pkg in ("cni", "nodeplug"):
        files += sorted((REPO / pkg).rglob("*.py"))
    for f in files:
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def missing() -> str:
    """Why a bundle cannot be built here, or ""."""
    if subprocess.run([python(), "-c", "import PyInstaller"], capture_output=True, check=False).returncode != 0:
        return f"PyInstaller is not installed for {python()} (dev dependency: pip install pyinstaller)"
    if shutil.which("gcc") is None or not any(Path(p).exists() for p in STATIC_LIBC):
        return "gcc with static glibc (libc6-dev) is needed to build the launcher"
    return ""


def build(cache: Path = CACHE, *extra: str, pythonpath: str = "") -> Path:
    """The bundle's directory, ``cache/<hash of its sources>``, built unless it is there (about 20 s; older builds
    in ``cache`` are removed, another session's build in progress is left alone); RuntimeError when the build
    fails."""
    out = cache / sources_hash()
    if not (out / "nodeplug").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".tmp-{os.getpid()}"
        env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
        p = subprocess.run(
            [python(), str(REPO / "scripts/build-cni-bundle"), "--out", str(tmp), *extra],
            capture_output=True, text=True, timeout=600, check=False, env=env,
        )  # fmt: skip
        if p.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"build-cni-bundle failed:\n{p.stdout}\n{p.stderr}")
        for old in cache.iterdir():
            if not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:  # another session finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
    return out
