"""The machine the benches run on: the repository, set-up commands, names and ports that do not clash."""

from __future__ import annotations

import secrets
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def sh(*argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
    """Run a command for set-up (argument list, no shell); raise with its stderr on failure."""
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def unique(prefix: str, n: int = 6) -> str:
    """A name unlikely to clash: ``prefix`` + random hex (keep interface names within 15 characters)."""
    return prefix + secrets.token_hex(n // 2 + 1)[:n]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(path: Path) -> bool:
    """Something accepts connections on the unix socket ``path`` (a socket a killed process left refuses them)."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True
