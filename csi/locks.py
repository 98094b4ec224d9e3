"""Per-key in-flight operation locks: a second operation on the same volume (or name) gets ABORTED.

The CSI spec asks a plugin to answer ABORTED when "an operation is pending for the specified volume" rather than
queue it; the caller (a sidecar or kubelet) retries with back-off. So these locks never wait: ``hold`` either takes
every key at once or raises :class:`csi.errors.Aborted` naming the busy key. Taking never blocks, so ``hold`` is a
plain (sync) context manager that is equally safe inside a coroutine or an ``asyncio.to_thread`` worker::

    with locks.hold(f"volume/{volume_id}"):
        ...

Keys are free-form; the convention is ``volume/<id>``, ``name/<name>``, ``snapshot/<id>``, ``target/<path>``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from csi.errors import Aborted


class OperationLocks:
    """A set of keys with an operation in flight."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: set[str] = set()

    @contextmanager
    def hold(self, *keys: str) -> Iterator[None]:
        """Hold all ``keys`` for the duration of the block; raise Aborted at once if any is already held."""
        wanted = {k for k in keys if k}
        with self._mutex:
            busy = sorted(wanted & self._held)
            if busy:
                raise Aborted(f"an operation on {busy[0]} is already in flight; retry later")
            self._held |= wanted
        try:
            yield
        finally:
            with self._mutex:
                self._held -= wanted

    def busy(self, key: str) -> bool:
        with self._mutex:
            return key in self._held
