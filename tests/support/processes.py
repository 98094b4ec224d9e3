"""Processes and threads in tests: many writers at once, a child killed at a chosen point, a child stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence


def run_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """``work(0)`` .. ``work(n - 1)``, each on a thread of its own, all at once; the exceptions they raised."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as e:  # reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def kill_9_when(argv: Sequence[str], line: str, timeout: float = 10) -> None:
    """Start ``argv``, wait until it prints ``line`` (alone on a line) and kill -9 it there, as a crash would."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline().strip()
        assert said == line, f"expected {line!r} from {argv[0]}, got {said!r}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout)
        if proc.stdout is not None:
            proc.stdout.close()


def stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
