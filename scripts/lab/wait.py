"""Waiting without sleeping a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Poll ``check()`` from a thread (no event loop) until it returns something true, and return that; fail, naming
    ``what``, after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)
