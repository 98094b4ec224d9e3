"""Crash-safe file writes shared by the plugins (CDI specs, CNI conflists, the installed entry point).

A reader sees the old file or the new one, never a part: the data goes to a hidden temporary sibling
(``.<name>.<random>.tmp``, a name neither CNI nor CDI loaders read), is fsync'd, renamed over the target, and the
directory is fsync'd so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably; the file gets ``mode``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
