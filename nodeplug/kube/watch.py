"""A resilient list+watch of one kind of object: the one way anything in the agent follows the API server.

:meth:`ListWatch.events` is an endless async iterator of :class:`Event`. It lists the collection (in pages, a
consistent read), reports the difference from what it reported before as ADDED / MODIFIED / DELETED events, then a
SYNCED event (the consumer now holds the whole collection as of that moment), and watches from the list's
resourceVersion:

- every event moves the resourceVersion on; BOOKMARK events (asked for with ``allowWatchBookmarks``) move it on
  without an object, so a quiet collection still resumes from a recent point;
- the server ends each watch after ``timeoutSeconds`` (randomised, as client-go does, so a fleet of agents does not
  reconnect in step) and the watch resumes from the last resourceVersion, without a list;
- 410 Gone (the resourceVersion has been compacted away, e.g. after an API server restart, or a watch cache that
  starts later than it) relists at once; the relist's diff emits DELETED for objects removed meanwhile, which a
  plain re-watch without a resourceVersion would never report;
- any other failure (connection refused or reset, timeout, 5xx, 429, 403 while RBAC is being set up) backs off
  exponentially with jitter (``Retry-After`` honoured) and resumes; nothing is lost, nothing raised. A watch that
  delivers nothing, not even a bookmark, for longer than its timeout is taken for a dead connection and restarted.

The iterator never ends by itself; cancel the task that consumes it (iterating :meth:`ListWatch.events` again
resumes from the last resourceVersion). :attr:`ListWatch.status` tells when the API last answered, when the
collection was last in sync, and the last error (for logs; :mod:`nodeplug.kube.health` says whether the API server
answers now). Objects are plain dicts as the API server sent them, keyed by ``namespace/name`` (``name`` for
cluster-scoped kinds), or what ``transform`` keeps of them. The list+watch holds the resourceVersion of every object
of the collection, and with ``keep_objects`` (the default) the objects too, for a consumer that reads them there; a
consumer that keeps its own parsed view (the cluster network) turns that off and its DELETED events carry a stub
(name, namespace, version), so the agent's memory does not grow with what it never reads.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightkube.core.resource import Resource

from nodeplug.kube.client import KubeApiError, KubeClient, KubeError, KubeUnavailable, resource_path
from nodeplug.log import Logger, get_logger

EventType = Literal["ADDED", "MODIFIED", "DELETED", "SYNCED"]
PAGE_SIZE = 500


@dataclass(frozen=True)
class Event:
    type: EventType
    key: str = ""  # namespace/name; "" for SYNCED
    obj: Mapping[str, Any] | None = None  # the object (its last known state for DELETED); None for SYNCED


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt n waits a random time in [d/2, d], d = min(cap, base * 2**n)."""

    base: float = 0.2
    cap: float = 10.0

    def delay(self, attempt: int, rng: Callable[[float, float], float] = random.uniform) -> float:
        d = min(self.cap, self.base * (2 ** min(attempt, 30)))
        return rng(d / 2, d)


@dataclass
class WatchStatus:
    connected: bool = False  # the last request reached the API server and the watch is open
    synced_at: float | None = None  # time.monotonic() of the last complete list
    last_contact: float | None = None  # time.monotonic() of the last answer from the API server
    last_error: str = ""
    relists: int = 0
    restarts: int = 0


class _Gone(Exception):
    """The resourceVersion we hold is too old: relist."""


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return ""
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return ""
    ns = meta.get("namespace")
    return f"{ns}/{name}" if isinstance(ns, str) and ns else name


def _rv(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return rv if isinstance(rv, str) else ""


def stub(key: str, rv: str = "") -> dict[str, Any]:
    """What a DELETED event carries for an object whose last state was not kept: its name, namespace, version."""
    ns, _, name = key.rpartition("/")
    meta: dict[str, Any] = {"name": name, "resourceVersion": rv, **({"namespace": ns} if ns else {})}
    return {"metadata": meta}


def diff(
    old: Mapping[str, str], new: Mapping[str, Mapping[str, Any]], last: Mapping[str, Mapping[str, Any]] | None = None
) -> list[Event]:
    """The events that turn the collection whose resourceVersions were ``old`` (key -> version) into ``new``
    (key -> object), deletions first; a deleted object's last state from ``last`` when kept, else a stub."""
    events = [
        Event("DELETED", k, (last or {}).get(k) or stub(k, rv)) for k, rv in old.items() if k not in new
    ]  # fmt: skip
    for k, obj in new.items():
        before = old.get(k)
        if before is None:
            events.append(Event("ADDED", k, obj))
        elif before != _rv(obj) or not before:
            events.append(Event("MODIFIED", k, obj))
    return events


class ListWatch:
    """Follow one collection (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        resource: type[Resource],
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        backoff: Backoff | None = None,
        watch_seconds: tuple[int, int] = (240, 480),
        page_size: int = PAGE_SIZE,
        log: Logger | None = None,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        keep_objects: bool = True,
    ) -> None:
        self.client = client
        self.path = resource_path(resource, namespace=namespace)
        self.kind = resource.__name__
        self.selectors = {
            k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v is not None
        }
        self.backoff = backoff or Backoff()
        self.watch_seconds = watch_seconds
        self.page_size = page_size
        self.log = log or get_logger("kube", kind=self.kind)
        self.transform = transform
        self.keep_objects = keep_objects
        self.versions: dict[str, str] = {}  # key -> resourceVersion of every object of the collection
        self.cache: dict[str, Mapping[str, Any]] = {}  # key -> object, when keep_objects
        self.resource_version = ""
        self.status = WatchStatus()

    async def events(self) -> AsyncIterator[Event]:
        failures = 0
        while True:
            try:
                if not self.resource_version:
                    async for ev in self._relist():
                        yield ev
                    failures = 0
                async for ev in self._watch():
                    failures = 0
                    yield ev
                self.status.restarts += 1  # the server ended the watch (timeoutSeconds): resume from where it was
            except _Gone:
                self.log.info("resourceVersion too old: listing again", resource_version=self.resource_version)
                self.resource_version = ""
            except KubeError as e:
                self.status.connected = False
                self.status.last_error = str(e)
                retry_after = e.retry_after if isinstance(e, KubeApiError) else None
                delay = max(self.backoff.delay(failures), retry_after or 0.0)
                failures += 1
                level = self.log.warning if failures in (1, 10) or failures % 50 == 0 else self.log.debug
                level("API request failed; retrying", error=str(e), attempt=failures, delay=round(delay, 2))
                await asyncio.sleep(delay)

    async def _relist(self) -> AsyncIterator[Event]:
        items: dict[str, Mapping[str, Any]] = {}
        params = {**self.selectors, "limit": str(self.page_size)}
        while True:
            try:
                page = await self.client.get_json(self.path, params)
            except KubeApiError as e:
                if e.code == 410 and "continue" in params:  # the continue token expired: start the list again
                    params.pop("continue")
                    items.clear()
                    continue
                raise
            self._contact()
            for obj in page.get("items") or ():
                if isinstance(obj, dict) and (key := object_key(obj)):
                    items[key] = self.transform(obj) if self.transform is not None else obj
            meta = page.get("metadata") if isinstance(page.get("metadata"), dict) else {}
            token = meta.get("continue") if isinstance(meta, dict) else None
            if not token:
                rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
                break
            params["continue"] = str(token)
        events = diff(self.versions, items, self.cache)
        self.versions = {k: _rv(obj) for k, obj in items.items()}
        self.cache = items if self.keep_objects else {}
        self.resource_version = rv if isinstance(rv, str) else ""
        self.status.relists += 1
        self.status.synced_at = time.monotonic()
        self.log.debug("listed", objects=len(items), changes=len(events), resource_version=self.resource_version)
        for ev in events:
            yield ev
        yield Event("SYNCED")

    async def _watch(self) -> AsyncIterator[Event]:
        seconds = random.randint(*self.watch_seconds)
        params = {
            **self.selectors,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version,
            "timeoutSeconds": str(seconds),
        }
        started, lines = time.monotonic(), 0
        try:
            async for line in self.client.stream_lines(self.path, params, read_timeout=seconds + 30):
                lines += 1
                self._contact()
                self.status.connected = True
                ev = self._apply(line)
                if ev is not None:
                    yield ev
        except KubeApiError as e:
            if e.code == 410:
                raise _Gone from None
            raise
        if not lines and time.monotonic() - started < 1.0:  # ended at once: never spin on a server that does that
            raise KubeUnavailable(f"watch {self.path}: the server ended it at once")

    def _apply(self, line: Mapping[str, Any]) -> Event | None:
        kind, obj = line.get("type"), line.get("object")
        if not isinstance(obj, dict):
            return None
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone
            raise KubeApiError(int(obj.get("code") or 500), str(obj.get("reason") or ""), str(obj.get("message") or ""))
        rv = _rv(obj)
        if rv:
            self.resource_version = rv
        if kind == "BOOKMARK":
            return None
        key = object_key(obj)
        if not key or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return None
        if self.transform is not None:
            obj = self.transform(obj)
        if kind == "DELETED":
            self.cache.pop(key, None)
            self.versions.pop(key, None)
            return Event("DELETED", key, obj)
        self.versions[key] = rv
        if self.keep_objects:
            self.cache[key] = obj
        return Event("ADDED" if kind == "ADDED" else "MODIFIED", key, obj)

    def _contact(self) -> None:
        self.status.last_contact = time.monotonic()
        self.status.last_error = ""
        self.status.connected = True
