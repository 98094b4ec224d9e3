"""Is the API server answering now? The agent's honest answer, for ``/readyz`` and for what depends on reaching it.

A watch cannot tell: a hung API server (stopped, or reached through a path that silently drops packets) keeps the
watch's connection open and says nothing until the watch's read timeout, minutes later. So :class:`ApiHealth`
asks: ``GET /version`` (served from memory, no etcd read; every client may ask, authenticated or not), bounded by
:data:`TIMEOUT`, every :data:`INTERVAL` seconds — unless some other request got an answer within that interval
(:attr:`~nodeplug.kube.client.KubeClient.last_answer`), which proves the same at no cost, so a busy agent in a
large cluster adds nearly nothing. A hang is seen within ``INTERVAL + TIMEOUT`` seconds, and a return at the next
probe.

:meth:`ApiHealth.changed` lets a plugin react to a change both ways (e.g. restart a watch whose connection died
with the path, or withdraw a route that took the path away).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from nodeplug.log import Logger, get_logger

if TYPE_CHECKING:
    from nodeplug.kube.client import KubeClient

INTERVAL = 4.0
TIMEOUT = 4.0


class ApiHealth:
    def __init__(
        self, kube: KubeClient, interval: float = INTERVAL, timeout: float = TIMEOUT, log: Logger | None = None
    ) -> None:
        self.kube = kube
        self.interval = interval
        self.timeout = timeout
        self.log = log or get_logger("kube")
        self.reachable: bool | None = None  # None until the first answer or failure
        self.since = time.monotonic()
        self.error = ""
        self._change = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def describe(self) -> str:
        if self.reachable is None:
            return "API server: not asked yet"
        for_ = f"for {time.monotonic() - self.since:.0f} s"
        return f"API server reachable {for_}" if self.reachable else f"API server unreachable {for_}: {self.error}"

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kube-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def changed(self) -> bool:
        """Wait for the next change of :attr:`reachable` and return the new value."""
        async with self._change:
            await self._change.wait()
            return bool(self.reachable)

    async def _run(self) -> None:
        from nodeplug.kube.client import KubeApiError, KubeUnavailable

        while True:
            recent = self.kube.last_answer is not None and time.monotonic() - self.kube.last_answer < self.interval
            if recent:
                await self._set(True, "")
            else:
                try:
                    await asyncio.wait_for(self.kube.get_json("/version"), self.timeout)
                except TimeoutError:
                    await self._set(False, f"no answer to GET /version within {self.timeout:g} s")
                except KubeUnavailable as e:
                    await self._set(False, str(e))
                except KubeApiError:  # an error status is still an answer
                    await self._set(True, "")
                else:
                    await self._set(True, "")
            await asyncio.sleep(self.interval)

    async def _set(self, reachable: bool, error: str) -> None:
        self.error = error
        if reachable == self.reachable:
            return
        was, self.reachable, self.since = self.reachable, reachable, time.monotonic()
        if reachable and was is not None:
            self.log.info("API server reachable again")
        elif not reachable:
            self.log.warning("API server unreachable", error=error)
        async with self._change:
            self._change.notify_all()
