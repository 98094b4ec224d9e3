"""Keeps this node's ResourceSlices equal to the devices offered through DRA, following the API server.

One task follows the driver's slices for this node (:class:`nodeplug.kube.ListWatch`, field selector on
``spec.nodeName`` and ``spec.driver``); another reconciles whenever :meth:`SlicePublisher.kick` is called (a
hotplug, a health change, a device taken or freed by the device plugin), whenever the watch shows a change made by
someone else (kubelet deletes a node's slices when it starts, and a driver's when the driver deregisters), and every
``resync_seconds``. Reconciling compares the published slices with the desired ones
(:func:`deviceplugin.dra.slices.up_to_date`); when they differ, the pool's generation is bumped past every one seen
and the slices are rewritten in place (replace, with the resourceVersion read), missing ones created and extra ones
deleted. Nothing is written before the first complete list, so a restarted agent updates what it published before
rather than adding to it.

The API server is followed, never waited on: while it is away the watch backs off and retries, a failed write is
retried with backoff, and the device plugin and the DRA gRPC service go on serving; the slices catch up when it is
back. :meth:`SlicePublisher.remove_all` deletes every slice of this driver on this node (the driver disabled).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence

from deviceplugin.dra import slices
from deviceplugin.dra.kubeapi import kinds, node_uid
from nodeplug.kube import Backoff, KubeClient, KubeError, ListWatch
from nodeplug.log import Logger

DEBOUNCE = 0.01


class SlicePublisher:
    def __init__(
        self,
        client: KubeClient,
        *,
        version: str,
        driver: str,
        node: str,
        desired: Callable[[], Sequence[slices.SliceDevice]],
        log: Logger,
        resync_seconds: float = 300.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.client = client
        self.version = version
        self.driver = driver
        self.node = node
        self.desired = desired
        self.log = log
        self.resync_seconds = resync_seconds
        self.backoff = backoff or Backoff(base=0.1, cap=10.0)
        self.kind = kinds(version).slice
        self.watch: ListWatch[slices.Slice] = ListWatch(
            client,
            self.kind,
            field_selector=f"spec.nodeName={node},spec.driver={driver}",
            backoff=backoff,
            log=log,
        )
        self.published: dict[str, slices.Slice] = {}  # name -> slice, from the watch and our own writes
        self.synced = False
        self.generation = 0
        self.last_error = ""
        self.current = False  # the last reconcile left the slices listing exactly the devices offered
        self._node_uid: str | None = None
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(), name="dra-slices-watch"),
            asyncio.create_task(self._reconcile_loop(), name="dra-slices-publish"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    def kick(self) -> None:
        self._kick.set()

    # ------------------------------------------------------------ following

    async def _follow(self) -> None:
        async for ev in self.watch.events():
            if ev.type == "SYNCED":
                self.published = dict(self.watch.cache)
                self.synced = True
            elif ev.type == "DELETED":
                self.published.pop(ev.key, None)
            elif ev.obj is not None:
                self.published[ev.key] = ev.obj
            if self.synced:  # someone else's change, or our own write coming back: compare, write on a difference
                self.kick()

    # ------------------------------------------------------------ reconciling

    async def _reconcile_loop(self) -> None:
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.resync_seconds)
            await asyncio.sleep(DEBOUNCE)
            self._kick.clear()
            if not self.synced:
                continue
            try:
                await self.reconcile()
                failures = 0
                self.last_error = ""
                self.current = True
            except KubeError as e:
                self.last_error = str(e)
                self.current = False
                delay = self.backoff.delay(failures, random.uniform)
                failures += 1
                level = self.log.warning if failures in (1, 10) or failures % 50 == 0 else self.log.debug
                level("ResourceSlices not updated; retrying", error=str(e), attempt=failures, delay=round(delay, 2))
                await asyncio.sleep(delay)
                self._kick.set()

    def _observed(self) -> list[slices.Observed]:
        out = []
        for obj in self.published.values():
            o = slices.observe(obj, version=self.version, driver=self.driver, node=self.node)
            if o is not None:
                out.append(o)
        return sorted(out, key=lambda o: o.name)

    async def reconcile(self) -> None:
        want = slices.chunks(self.desired())
        have = self._observed()
        if slices.up_to_date(have, want):
            self.generation = max(self.generation, have[0].generation if have else 0)
            return
        if self._node_uid is None:
            self._node_uid = await node_uid(self.client, self.node)
        self.generation = max([self.generation, *(o.generation for o in have)]) + 1
        for i, chunk in enumerate(want):
            obj = slices.slice_object(
                version=self.version,
                driver=self.driver,
                node=self.node,
                node_uid=self._node_uid,
                generation=self.generation,
                count=len(want),
                devices=chunk,
                name=have[i].name if i < len(have) else "",
                resource_version=have[i].resource_version if i < len(have) else "",
            )
            stored = await (self.client.replace(obj) if i < len(have) else self.client.create(obj))
            if stored.metadata is not None and stored.metadata.name:
                self.published[stored.metadata.name] = stored
        for extra in have[len(want) :]:
            await self.client.delete(self.kind, extra.name)
            self.published.pop(extra.name, None)
        self.log.info(
            "ResourceSlices updated",
            generation=self.generation,
            slices=len(want),
            devices=sum(len(c) for c in want),
        )

    async def remove_all(self) -> None:
        """Delete every slice of this driver on this node (listed afresh: the watch may not have synced)."""
        mine = await self.client.list(self.kind, fields={"spec.nodeName": self.node, "spec.driver": self.driver})
        names = {
            o.name for s in mine if (o := slices.observe(s, version=self.version, driver=self.driver, node=self.node))
        }
        for name in sorted(names | set(self.published)):
            await self.client.delete(self.kind, name)
            self.published.pop(name, None)
