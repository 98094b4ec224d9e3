"""The one cache of the Kubernetes binaries: each ``NAME.xz`` of KUBE_ASSETS unpacked once, keyed by its content.

``unpack(KUBE_ASSETS/NAME.xz)`` gives ``CACHE/bin/<first 16 hex digits of its sha256>/NAME``. A changed archive gets
a new directory; an unchanged one is never unpacked twice. Several processes may unpack the same binary at once (two
test sessions, cluster-up beside them): each writes a temporary file of its own in the target directory and renames
it into place, so a reader sees no binary or a whole one, never a half-written one.

Used by scripts/cluster (cluster-up) and by the tests and benchmarks (``scripts/lab/kubeassets.py`` loads this file
by its path: the tests' package ``cluster`` shadows this one). Standard library only, and no import of the rest of
scripts/cluster, so that it loads alone.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assets_dir() -> Path:
    """``$KUBE_ASSETS`` (a relative value is taken from the repository), default ``../shared/kube`` beside it."""
    folder = Path(os.environ.get("KUBE_ASSETS", "../shared/kube"))
    return folder if folder.is_absolute() else (REPO / folder).resolve()


def cache_dir() -> Path:
    """``$NODEPLUG_CLUSTER_CACHE`` (relative: from the repository), default ``build/cluster-cache``."""
    folder = Path(os.environ.get("NODEPLUG_CLUSTER_CACHE", "build/cluster-cache"))
    return folder if folder.is_absolute() else (REPO / folder).resolve()


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """The archive's sha256, once per process for a file that did not change (same size, time and inode)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def digest(path: Path) -> str:
    st = path.stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


def unpack(packed: Path, cache: Path | None = None) -> Path:
    """``packed`` (``NAME.xz``) unpacked to ``cache/bin/<sha256>/NAME`` (``cache`` default :func:`cache_dir`),
    executable; done once per content. Raises FileNotFoundError when ``packed`` is absent."""
    if not packed.name.endswith(".xz"):
        raise ValueError(f"{packed}: expected an xz-compressed binary (NAME.xz)")
    name = packed.name[: -len(".xz")]
    out = (cache or cache_dir()) / "bin" / digest(packed)[:16] / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out.parent)  # unique per process and thread
    try:
        with lzma.open(packed) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: a concurrent unpacker's rename of the same content is harmless
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
