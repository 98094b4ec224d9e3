"""A state database as a file, read from outside the code that owns it (what a restart or an upgrade finds)."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def user_version(path: Path) -> int:
    """The schema version recorded in the file (SQLite's ``user_version``)."""
    c = sqlite3.connect(path)
    try:
        return int(c.execute("PRAGMA user_version").fetchone()[0])
    finally:
        c.close()
