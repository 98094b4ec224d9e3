"""Waiting in tests without sleeping a guessed time (:func:`wait_for` is :mod:`lab.wait`'s, shared with the
benchmarks)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.wait import wait_for

__all__ = ["eventually", "running", "wait_for"]


async def eventually(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Wait until ``cond()`` holds, for state that announces no change (a file, a counter in the plugin): checked
    every few milliseconds, failing after ``timeout`` (a deadlock breaker, not a speed requirement)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.005)


def running(proc: subprocess.Popen[Any], log: Path | None = None) -> bool:
    """True while ``proc`` runs, for the checks of :func:`wait_for`; once it has exited, an AssertionError with the
    end of its ``log``, so a wait for something it should make fails at once instead of at the timeout."""
    if proc.poll() is not None:
        raise AssertionError(f"exited with {proc.returncode}: {log.read_text()[-3000:] if log else ''}")
    return True
