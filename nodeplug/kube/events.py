"""Kubernetes Events (``events.k8s.io/v1``) for the decisions an operator must see, without ever holding anyone up.

A plugin calls :meth:`EventRecorder.emit` (synchronous, never blocks, never raises) with the object the event is
about (:class:`Regarding`: this Node, or the Pod, PVC or ResourceClaim concerned), its type (``Normal`` or
``Warning``), a reason (``CamelCase``), an action and a note. One background task sends them:

- **Deduplicated**: the same event (object, type, reason, action, note) again within :data:`SERIES_WINDOW` becomes a
  series on the first Event object (``series.count``, ``series.lastObservedTime``), patched at most once per
  :data:`SERIES_PATCH_EVERY` seconds however often it recurs (a flapping route does not write to etcd in a loop);
- **Rate-limited** per object as client-go's spam filter does: a burst of :data:`BURST` new events, then one per
  :data:`REFILL_SECONDS`; what is over the limit is dropped and counted (``nodeplug_events_dropped_total``);
- **Bounded**: at most :data:`QUEUE_LIMIT` events wait while the API server is away (the oldest go first), each
  retried with backoff for at most :data:`GIVE_UP_SECONDS`. Events are best-effort: the agent's work never waits on
  them, and the log carries the same decisions.

Events about a Node are written in namespace ``default`` with ``regarding.uid`` set to the node name, as kubelet
does, so that ``kubectl describe node`` lists them. The event's name is ``<object>.<hex time>`` (client-go's form,
the time kept increasing so that no two Events share a name); ``reportingController`` is ``nodeplug.io/agent`` and
``reportingInstance`` ``nodeplug-<node>``. The RBAC is ``create`` and ``patch`` on ``events.events.k8s.io``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter

from nodeplug.log import Logger, get_logger

if TYPE_CHECKING:
    from nodeplug.kube.client import KubeClient

EventType = Literal["Normal", "Warning"]

CONTROLLER = "nodeplug.io/agent"
NODE_EVENTS_NAMESPACE = "default"
SERIES_WINDOW = 30 * 60.0
SERIES_PATCH_EVERY = 30.0
BURST = 25
REFILL_SECONDS = 300.0
QUEUE_LIMIT = 1000
GIVE_UP_SECONDS = 600.0
MAX_NOTE = 1024
MAX_FIELD = 128
_KEEP_KEYS = 4096  # series remembered at most (least recently seen forgotten first)


@dataclass(frozen=True)
class Regarding:
    """The object an event is about."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"

    @classmethod
    def node(cls, name: str) -> Regarding:
        return cls("Node", name, uid=name)

    @property
    def event_namespace(self) -> str:
        return self.namespace or NODE_EVENTS_NAMESPACE


@dataclass(frozen=True)
class _Key:
    regarding: Regarding
    type: EventType
    reason: str
    action: str
    note: str


@dataclass
class _Series:
    name: str = ""  # the Event object's name once created
    first: float = 0.0
    last: float = 0.0
    count: int = 1
    sent_count: int = 0  # the count the API server has
    last_patch: float = 0.0


@dataclass
class _Bucket:
    tokens: float = BURST
    at: float = field(default_factory=time.monotonic)

    def take(self, now: float) -> bool:
        self.tokens = min(BURST, self.tokens + (now - self.at) / REFILL_SECONDS)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _micro(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


class EventRecorder:
    def __init__(
        self,
        kube: KubeClient,
        node: str,
        registry: CollectorRegistry | None = None,
        log: Logger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.node = node
        self.instance = _clip(f"nodeplug-{node}", MAX_FIELD)
        self.log = log or get_logger("events")
        self.clock = clock
        self._series: OrderedDict[_Key, _Series] = OrderedDict()
        self._buckets: dict[Regarding, _Bucket] = {}
        self._queue: deque[_Key] = deque()
        self._due: dict[_Key, float] = {}  # series recurred soon after a patch: their next patch, by clock time
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is queued for sending now
        self._task: asyncio.Task[None] | None = None
        self._stamp = 0  # the last Event name's time stamp (nanoseconds), kept increasing
        self.emitted = Counter(
            "nodeplug_events", "Kubernetes Events recorded, by type and reason.", ["type", "reason"], registry=registry
        )
        self.dropped = Counter(
            "nodeplug_events_dropped",
            "Kubernetes Events not sent: over the rate limit, the queue full, or the API server away too long.",
            ["cause"],
            registry=registry,
        )

    # ------------------------------------------------------------ the callers' side

    def emit(self, regarding: Regarding, type: EventType, reason: str, note: str, action: str = "") -> None:
        """Record an event (see the module docstring); returns at once."""
        key = _Key(regarding, type, _clip(reason, MAX_FIELD), _clip(action or reason, MAX_FIELD), _clip(note, MAX_NOTE))
        now = self.clock()
        series = self._series.get(key)
        if series is not None and now - series.last < SERIES_WINDOW:
            series.count += 1
            series.last = now
            self._series.move_to_end(key)
        else:
            if not self._buckets.setdefault(regarding, _Bucket()).take(time.monotonic()):
                self.dropped.labels("rate limit").inc()
                return
            self._series[key] = _Series(first=now, last=now)
            self._series.move_to_end(key)
            while len(self._series) > _KEEP_KEYS:
                self._series.popitem(last=False)
        self.emitted.labels(type, key.reason).inc()
        series = self._series[key]
        if series.name and now - series.last_patch < SERIES_PATCH_EVERY:
            self._due.setdefault(key, series.last_patch + SERIES_PATCH_EVERY)
        elif key not in self._queue:
            self._idle.clear()
            self._queue.append(key)
            if len(self._queue) > QUEUE_LIMIT:
                self._queue.popleft()
                self.dropped.labels("queue full").inc()
        self._wake.set()

    # ------------------------------------------------------------ the sender

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kube-events")

    async def stop(self) -> None:
        """Send what is queued for a moment (at most 2 s), then stop."""
        task, self._task = self._task, None
        if task is None:
            return
        if self._queue:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._idle.wait()), 2.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        failures = 0
        while True:
            key = self._next()
            if key is None:
                self._idle.set()
                due = min(self._due.values(), default=None)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), None if due is None else max(due - self.clock(), 0.0))
                continue
            self._idle.clear()
            series = self._series.get(key)
            if series is None:  # forgotten meanwhile
                continue
            try:
                await self._send(key, series)
            except Exception as e:
                failures += 1
                if self.clock() - series.last > GIVE_UP_SECONDS:
                    self.dropped.labels("api unavailable").inc()
                    self.log.warning("event not recorded", reason=key.reason, error=str(e) or repr(e))
                else:
                    self._queue.appendleft(key)
                await asyncio.sleep(min(30.0, 0.2 * 2 ** min(failures, 8)))
                continue
            failures = 0
            if series.count > series.sent_count:  # it recurred while being sent: its next patch is due later
                self._due[key] = series.last_patch + SERIES_PATCH_EVERY

    def _next(self) -> _Key | None:
        """The next event to send: the queue's head, else a series whose patch is due."""
        if self._queue:
            return self._queue.popleft()
        now = self.clock()
        for key, due in self._due.items():
            if due <= now:
                del self._due[key]
                return key
        return None

    async def _send(self, key: _Key, series: _Series) -> None:
        from lightkube.models.core_v1 import ObjectReference
        from lightkube.models.events_v1 import EventSeries
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.events_v1 import Event

        count, last = series.count, series.last
        if series.name:
            patch = {"series": {"count": count, "lastObservedTime": _micro(last).isoformat(timespec="microseconds")}}
            await self.kube.patch(Event, series.name, patch, namespace=key.regarding.event_namespace)
            series.sent_count, series.last_patch = count, self.clock()
            return
        r = key.regarding
        # client-go's name, <object>.<hex nanoseconds>, made unique: events first seen within one tick of the clock
        # (a float's nanoseconds step by hundreds) would otherwise share a name, and all but one be refused
        self._stamp = max(int(series.first * 1e9), self._stamp + 1)
        name = f"{_clip(r.name, 200)}.{self._stamp:x}"
        event = Event(
            metadata=ObjectMeta(name=name, namespace=r.event_namespace),
            eventTime=_micro(series.first),
            series=EventSeries(count=count, lastObservedTime=_micro(last)) if count > 1 else None,
            reportingController=CONTROLLER,
            reportingInstance=self.instance,
            action=key.action,
            reason=key.reason,
            note=key.note,
            type=key.type,
            regarding=ObjectReference(
                apiVersion=r.api_version, kind=r.kind, name=r.name, namespace=r.namespace or None, uid=r.uid or None
            ),
        )
        await self.kube.create(event)
        series.name, series.sent_count, series.last_patch = name, count, self.clock()
