"""Pre-provisioned snapshots: VolumeSnapshotContents made by hand are taken up by the node that holds the snapshot.

The DaemonSet runs csi-snapshotter with ``--node-deployment``: each node's snapshotter follows only the contents
labelled ``snapshot.storage.kubernetes.io/managed-by=<its node>``. snapshot-controller
(``--enable-distributed-snapshotting``) labels the contents it makes for new snapshots from the source volume's node,
but a content a user writes to import an existing snapshot (after a restore, a migration, a re-created cluster, a
VolumeSnapshot deleted with ``deletionPolicy: Retain``) carries no label, and no snapshotter would ever look at it.

:class:`SnapshotImporter` follows the VolumeSnapshotContents (one :class:`~nodeplug.kube.ListWatch`) and decides for
each with :func:`decide`:

- a content of this driver whose ``spec.source.snapshotHandle`` is a snapshot this node's store holds, and that has
  no managed-by label, is **adopted**: the agent sets the label to its own Node's name (a merge patch carrying the
  resourceVersion it saw, so two writers never both win), and this node's csi-snapshotter takes it from there
  (ListSnapshots fills its status, and a VolumeSnapshot bound to it becomes ready);
- a content naming a snapshot that no running agent holds gets an Event (reason ``SnapshotNotFound``, on the
  content and on the VolumeSnapshot it is bound to) from exactly one agent: the one the content's name picks among
  the nodes where kubelet has this driver registered (rendezvous hashing over the CSINodes listing it; every agent
  computes the same choice from the same list). That agent waits :data:`GRACE_SECONDS` first, so the holder's
  adoption is seen before anyone says it has none; the note says that a node whose agent is down cannot answer;
- anything else (another driver, a content made for a new snapshot, one already labelled, whoever's) is left alone.

Contents are re-examined every :data:`RESYNC_SECONDS` (a snapshot restored onto a node, an agent started again).
The admission policy in daemonset/rbac.yaml lets an agent set that label only to its own Node's name, only where
there was none, and change nothing else with it. Everything read from the API is hostile: the handle is looked up
only if it has the shape of an ID this driver issues.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from lightkube.core.resource import GlobalResource, api_info
from lightkube.generic_resource import create_global_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.storage_v1 import CSINode

from csi.model import issued
from nodeplug.kube import KubeClient, KubeError, ListWatch
from nodeplug.kube.events import EventRecorder, Regarding
from nodeplug.log import Logger

MANAGED_BY = "snapshot.storage.kubernetes.io/managed-by"
GROUP, VERSION = "snapshot.storage.k8s.io", "v1"
GRACE_SECONDS = 15.0
RESYNC_SECONDS = 300.0

# lightkube's generic resource for the CRD: the path, and what a patch is sent to
VolumeSnapshotContentResource = create_global_resource(
    GROUP, VERSION, "VolumeSnapshotContent", "volumesnapshotcontents"
)


# The content typed at the edge: only what the importer reads, checked against these types when it is decoded.
@dataclass
class ContentSource:
    snapshotHandle: str | None = None
    volumeHandle: str | None = None


@dataclass
class SnapshotRef:
    name: str | None = None
    namespace: str | None = None
    uid: str | None = None


@dataclass
class ContentSpec:
    driver: str = ""
    source: ContentSource | None = None
    volumeSnapshotRef: SnapshotRef | None = None


@dataclass
class VolumeSnapshotContent(GlobalResource):
    apiVersion: str | None = None
    kind: str | None = None
    metadata: ObjectMeta | None = None
    spec: ContentSpec | None = None

    _api_info = api_info(VolumeSnapshotContentResource)


@dataclass(frozen=True)
class Content:
    """A VolumeSnapshotContent as the importer sees it."""

    name: str
    uid: str
    resource_version: str
    driver: str
    snapshot_handle: str  # spec.source.snapshotHandle: "" for a content made for a new snapshot
    managed_by: str  # the label's value, "" when absent
    snapshot: Regarding | None  # the VolumeSnapshot it is bound to, when it names one

    @classmethod
    def of(cls, obj: VolumeSnapshotContent) -> Content | None:
        meta, spec = obj.metadata, obj.spec
        if meta is None or not meta.name or spec is None:
            return None
        ref = spec.volumeSnapshotRef
        snapshot = None
        if ref is not None and ref.name and ref.namespace:
            snapshot = Regarding("VolumeSnapshot", ref.name, ref.namespace, ref.uid or "", f"{GROUP}/{VERSION}")
        return cls(
            name=meta.name,
            uid=meta.uid or "",
            resource_version=meta.resourceVersion or "",
            driver=spec.driver,
            snapshot_handle=(spec.source.snapshotHandle or "") if spec.source else "",
            managed_by=(meta.labels or {}).get(MANAGED_BY, ""),
            snapshot=snapshot,
        )


Decision = Literal["adopt", "unclaimed", "leave"]


def decide(c: Content, *, driver: str, holds: bool) -> Decision:
    """What this node's agent does with ``c``, ``holds`` saying whether its store has the snapshot the content
    names: adopt it, leave it, or (``unclaimed``: a content waiting for a node, not this one) see after the grace
    whether anyone took it, and if not, say so if this agent is the one to speak."""
    if c.driver != driver or not c.snapshot_handle or c.managed_by:
        return "leave"
    return "adopt" if holds else "unclaimed"


def reporter(content: str, nodes: Iterable[str]) -> str:
    """The node whose agent speaks for ``content`` (rendezvous hashing: the same answer on every node given the same
    list, and a node joining or leaving moves only the contents it wins or held); "" for no nodes."""
    return max(nodes, key=lambda n: hashlib.sha256(f"{content}\0{n}".encode()).digest(), default="")


def driver_nodes(csinodes: Iterable[CSINode], driver: str) -> set[str]:
    """The nodes whose kubelet has ``driver`` registered (their agents run and serve it)."""
    out = set()
    for n in csinodes:
        if n.metadata is not None and n.metadata.name and any(d.name == driver for d in n.spec.drivers or ()):
            out.add(n.metadata.name)
    return out


class SnapshotImporter:
    """Follows VolumeSnapshotContents and CSINodes; adopts this node's snapshots, reports those nobody holds."""

    def __init__(
        self,
        client: KubeClient,
        *,
        driver: str,
        node: str,
        holds: Callable[[str], Awaitable[bool]],
        events: EventRecorder | None,
        log: Logger,
        grace_seconds: float = GRACE_SECONDS,
    ) -> None:
        self.client = client
        self.driver = driver
        self.node = node
        self.holds = holds
        self.events = events
        self.log = log
        self.grace_seconds = grace_seconds
        self.contents: ListWatch[VolumeSnapshotContent] = ListWatch(client, VolumeSnapshotContent, log=log)
        self.csinodes: ListWatch[CSINode] = ListWatch(client, CSINode, log=log)
        self.nodes: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[str, asyncio.Task[None]] = {}  # content name -> its delayed report
        self._reported: set[tuple[str, str]] = set()  # (uid, resourceVersion) already reported

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow_nodes(), name="csi-import-nodes"),
            asyncio.create_task(self._follow_contents(), name="csi-import-contents"),
            asyncio.create_task(self._resync(), name="csi-import-resync"),
        ]

    async def stop(self) -> None:
        tasks = self._tasks + list(self._pending.values())
        self._tasks, self._pending = [], {}
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _follow_nodes(self) -> None:
        async for _ in self.csinodes.events():
            if self.csinodes.status.synced_at is not None:
                self.nodes = driver_nodes(self.csinodes.cache.values(), self.driver)

    async def _follow_contents(self) -> None:
        async for ev in self.contents.events():
            if ev.type == "SYNCED":
                for obj in list(self.contents.cache.values()):
                    await self._examine(obj)
            elif ev.type != "DELETED" and ev.obj is not None:
                await self._examine(ev.obj)

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            for obj in list(self.contents.cache.values()):
                await self._examine(obj)

    async def _examine(self, obj: VolumeSnapshotContent) -> None:
        c = Content.of(obj)
        if c is None or c.driver != self.driver or not c.snapshot_handle or c.managed_by:
            return
        holds = issued("snapshot_handle", c.snapshot_handle) and await self.holds(c.snapshot_handle)
        action = decide(c, driver=self.driver, holds=holds)
        if action == "adopt":
            await self._adopt(c)
        elif (
            action == "unclaimed" and c.name not in self._pending and (c.uid, c.resource_version) not in self._reported
        ):
            self._pending[c.name] = asyncio.create_task(self._report_later(c), name=f"csi-import-report-{c.name}")

    async def _adopt(self, c: Content) -> None:
        patch = {"metadata": {"labels": {MANAGED_BY: self.node}, "resourceVersion": c.resource_version}}
        try:
            await self.client.patch(VolumeSnapshotContentResource, c.name, patch)
        except KubeError as e:  # a conflict: someone changed it meanwhile; the watch brings the new version
            self.log.warning(
                "snapshot content not adopted", content=c.name, snapshot_id=c.snapshot_handle, error=str(e)
            )
            return
        self.log.info("snapshot content adopted", content=c.name, snapshot_id=c.snapshot_handle)
        if self.events is not None:
            note = f"snapshot {c.snapshot_handle} is on node {self.node}: its csi-snapshotter takes this content"
            self.events.emit(self._regarding(c), "Normal", "SnapshotContentAdopted", note, "Import")

    async def _report_later(self, c: Content) -> None:
        try:
            await asyncio.sleep(self.grace_seconds)
            current = self.contents.cache.get(c.name)
            now = Content.of(current) if current is not None else None
            if now is None or now.uid != c.uid or now.managed_by or now.snapshot_handle != c.snapshot_handle:
                return  # gone, replaced, or adopted meanwhile
            if reporter(c.name, self.nodes) != self.node:
                return  # another agent speaks for this one
            self._reported.add((now.uid, now.resource_version))
            if not issued("snapshot_handle", c.snapshot_handle):
                why = "is not a snapshot ID this driver issues"
            else:
                why = f"is held by none of the {len(self.nodes)} nodes whose agent is running"
            note = (
                f"snapshotHandle {c.snapshot_handle[:200]!r} {why}, so no node's csi-snapshotter takes this content "
                f"(a node whose agent is down cannot answer; the content is taken up once that agent runs)"
            )
            self.log.warning("snapshot content names no snapshot of a running agent", content=c.name)
            if self.events is not None:
                self.events.emit(self._regarding(c), "Warning", "SnapshotNotFound", note, "Import")
                if c.snapshot is not None:
                    self.events.emit(c.snapshot, "Warning", "SnapshotNotFound", f"content {c.name}: {note}", "Import")
        finally:
            self._pending.pop(c.name, None)

    @staticmethod
    def _regarding(c: Content) -> Regarding:
        return Regarding("VolumeSnapshotContent", c.name, uid=c.uid, api_version=f"{GROUP}/{VERSION}")
