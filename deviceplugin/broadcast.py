"""One latest-value broadcast: every subscriber sees the current value, then every newer one.

The device table of a resource publishes each changed listing here; every open ListAndWatch stream subscribes. A
subscriber's queue holds one item, the newest: a slow stream skips intermediate listings and never falls behind,
since only the latest listing matters to kubelet. :meth:`close` ends every subscription cleanly; a subscriber that is
cancelled (kubelet closed the stream) removes itself in ``finally``, so nothing is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Generic, TypeVar

T = TypeVar("T")

_CLOSED = object()


class Broadcast(Generic[T]):
    def __init__(self, initial: T) -> None:
        self._value = initial
        self._queues: set[asyncio.Queue[object]] = set()
        self._closed = False

    @property
    def subscribers(self) -> int:
        return len(self._queues)

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, value: T) -> None:
        self._value = value
        for q in self._queues:
            _replace(q, value)

    def close(self) -> None:
        self._closed = True
        for q in self._queues:
            _replace(q, _CLOSED)

    async def subscribe(self) -> AsyncGenerator[T, None]:
        if self._closed:
            return
        q: asyncio.Queue[object] = asyncio.Queue(maxsize=1)
        self._queues.add(q)
        try:
            yield self._value
            while True:
                item = await q.get()
                if item is _CLOSED:
                    return
                yield item  # type: ignore[misc]
        finally:
            self._queues.discard(q)


def _replace(q: asyncio.Queue[object], item: object) -> None:
    if q.full():
        q.get_nowait()
    q.put_nowait(item)
