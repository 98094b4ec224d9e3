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
answers now).

Objects are the kind's lightkube model (``ListWatch(client, Node)`` yields ``lightkube.resources.core_v1.Node``),
decoded here and checked against the kind's schema, keyed by ``namespace/name`` (``name`` for cluster-scoped kinds);
``transform`` first keeps what the consumer reads of the object as the API server sent it (the rest is never
decoded). An object sent in another shape is not one the agent can use: it is logged once per version and counts as
absent (DELETED, if it was there), while the others go on. The list+watch holds the resourceVersion of every object
of the collection, and with ``keep_objects`` (the default) the objects too, for a consumer that reads them there; a
consumer that keeps its own parsed view (the cluster network) turns that off, so the agent's memory does not grow
with what it never reads. A DELETED event carries the object's last state when there is one to give (kept, or sent
with the deletion), else None: its key names what went.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
from lightkube.core.resource import Resource

from nodeplug.kube.client import KubeApiError, KubeClient, KubeError, KubeUnavailable, decode, resource_path
from nodeplug.log import Logger, get_logger

EventType = Literal["ADDED", "MODIFIED", "DELETED", "SYNCED"]
PAGE_SIZE = 500

R = TypeVar("R", bound=Resource)


@dataclass(frozen=True)
class Event(Generic[R]):
    type: EventType
    key: str = ""  # namespace/name; "" for SYNCED
    obj: R | None = None  # the object; for DELETED its last state when there is one to give; None for SYNCED


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


def diff(
    old: Mapping[str, str], new: Mapping[str, str], objects: Mapping[str, R], last: Mapping[str, R]
) -> list[Event[R]]:
    """The events that turn the collection whose resourceVersions were ``old`` (key -> version) into the one whose
    versions are ``new`` (with its ``objects``), deletions first; a deleted object's last state from ``last`` when
    kept, else None."""
    events: list[Event[R]] = [Event("DELETED", k, last.get(k)) for k in old if k not in new]
    for k, rv in new.items():
        before = old.get(k)
        if before is None:
            events.append(Event("ADDED", k, objects[k]))
        elif before != rv or not before:
            events.append(Event("MODIFIED", k, objects[k]))
    return events


class ListWatch(Generic[R]):
    """Follow one collection (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        resource: type[R],
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
        self.resource = resource
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
        self.cache: dict[str, R] = {}  # key -> object, when keep_objects
        self.resource_version = ""
        self.status = WatchStatus()
        self._refused: dict[str, str] = {}  # key -> the resourceVersion of the object last refused (logged once)

    def _decode(self, key: str, raw: dict[str, Any]) -> R | None:
        """What ``transform`` keeps of the object, as its model; None (said once per version) when it is not of the
        kind's schema."""
        try:
            obj = decode(self.transform(raw) if self.transform is not None else raw, self.resource)
        except msgspec.ValidationError as e:
            if self._refused.get(key) != _rv(raw):
                self._refused[key] = _rv(raw)
                self.log.warning("an object not of its kind's schema: taken as absent", key=key, error=str(e))
            return None
        self._refused.pop(key, None)
        return obj

    async def events(self) -> AsyncIterator[Event[R]]:
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

    async def _relist(self) -> AsyncIterator[Event[R]]:
        items: dict[str, R] = {}
        versions: dict[str, str] = {}
        params = {**self.selectors, "limit": str(self.page_size)}
        while True:
            try:
                page = await self.client.get_json(self.path, params)
            except KubeApiError as e:
                if e.code == 410 and "continue" in params:  # the continue token expired: start the list again
                    params.pop("continue")
                    items.clear()
                    versions.clear()
                    continue
                raise
            self._contact()
            for raw in page.get("items") or ():
                if isinstance(raw, dict) and (key := object_key(raw)) and (obj := self._decode(key, raw)):
                    items[key], versions[key] = obj, _rv(raw)
            meta = page.get("metadata") if isinstance(page.get("metadata"), dict) else {}
            token = meta.get("continue") if isinstance(meta, dict) else None
            if not token:
                rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
                break
            params["continue"] = str(token)
        events = diff(self.versions, versions, items, self.cache)
        self.versions = versions
        self.cache = items if self.keep_objects else {}
        self.resource_version = rv if isinstance(rv, str) else ""
        self.status.relists += 1
        self.status.synced_at = time.monotonic()
        self.log.debug("listed", objects=len(items), changes=len(events), resource_version=self.resource_version)
        for ev in events:
            yield ev
        yield Event("SYNCED")

    async def _watch(self) -> AsyncIterator[Event[R]]:
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

    def _apply(self, line: Mapping[str, Any]) -> Event[R] | None:
        kind, raw = line.get("type"), line.get("object")
        if not isinstance(raw, dict):
            return None
        if kind == "ERROR":
            if raw.get("code") == 410:
                raise _Gone
            raise KubeApiError(int(raw.get("code") or 500), str(raw.get("reason") or ""), str(raw.get("message") or ""))
        rv = _rv(raw)
        if rv:
            self.resource_version = rv
        if kind == "BOOKMARK":
            return None
        key = object_key(raw)
        if not key or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return None
        obj = self._decode(key, raw)
        if kind == "DELETED" or obj is None:  # gone, or no longer of a shape the agent can use
            before = self.cache.pop(key, None)
            known = self.versions.pop(key, None) is not None
            if kind == "DELETED":
                self._refused.pop(key, None)
            if kind == "DELETED" or known:
                return Event("DELETED", key, obj or before)
            return None
        known = key in self.versions
        self.versions[key] = rv
        if self.keep_objects:
            self.cache[key] = obj
        return Event("MODIFIED" if known or kind == "MODIFIED" else "ADDED", key, obj)

    def _contact(self) -> None:
        self.status.last_contact = time.monotonic()
        self.status.last_error = ""
        self.status.connected = True
