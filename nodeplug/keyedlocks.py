"""One lock per key (a container ID, a claim UID), forgotten when nobody holds or waits for it: requests for one key
run one at a time, requests for different keys side by side, and keys that are done with leave nothing.
:class:`KeyedLocks` for coroutines, :class:`ThreadKeyedLocks` for threads."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> its lock, how many hold or wait for it

    def __len__(self) -> int:
        """How many keys have a lock now (held or waited for)."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold ``key``'s lock for the block; an empty key locks nothing."""
        if not key:
            yield
            return
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class ThreadKeyedLocks:
    """:class:`KeyedLocks` for threads: ``with locks.hold(key):``."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[threading.Lock, int]] = {}
        self._guard = threading.Lock()

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Hold ``key``'s lock for the block; an empty key locks nothing."""
        if not key:
            yield
            return
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            if lock is None:
                lock = threading.Lock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                _, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)
