"""Snapshots and group snapshots: point-in-time copies of volumes, cut consistently.

:class:`Snapshots` is a collaborator of :class:`csi.volumes.VolumeManager` (``manager.snapshots``): it works over the
state store and the operation locks it is given and reaches volumes, backends and free space only through the narrow
:class:`VolumeAccess` the manager provides.

Consistency: a staged ext4/xfs volume is frozen (``fsfreeze``) at its staging path while it is copied; a staged block
volume has its device's buffered writes flushed to the backing file first; a group snapshot freezes every member,
copies all, then thaws, so the members are write-order consistent with each other. A staged block volume or btrfs
subvolume cannot be frozen, so it can be snapshotted alone (crash-consistent) but not together with others
(FAILED_PRECONDITION, as the spec's group-snapshot table says). An agent killed while a filesystem is frozen leaves it
frozen: :meth:`Snapshots.thaw_all` undoes that at start.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

from csi import holders, mounts
from csi.backends import Backend, fileops
from csi.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from csi.locks import OperationLocks
from csi.model import GroupSnapshot, Snapshot, Volume, derive_id, issued, validate_id, validate_name
from csi.state import StateStore
from nodeplug.log import get_logger

_log = get_logger("csi")
# Keys the CO's sidecars add themselves (external-provisioner --extra-create-metadata, snapshotter): ignored.
PASSTHROUGH_PREFIXES = ("csi.storage.k8s.io/",)


def takes_no_parameters(parameters: Mapping[str, str], what: str) -> None:
    """Refuse every parameter but those the sidecars pass through (``csi.storage.k8s.io/...``)."""
    for key in parameters:
        if not key.startswith(PASSTHROUGH_PREFIXES):
            raise InvalidArgument(f"parameters.{key}: unknown parameter ({what} take none)")


class VolumeAccess(Protocol):
    """What snapshots need of the volume manager."""

    def backend(self, name: str, what: str = "parameters.backend") -> Backend:
        """The enabled backend called ``name`` (``what`` names the field in errors)."""
        ...

    def volume(self, volume_id: str, field: str = "volume_id") -> Volume:
        """The recorded volume ``volume_id``; NOT_FOUND naming ``field`` otherwise."""
        ...

    def reserve(self, be: Backend, size: int, count: bool = True) -> contextlib.AbstractContextManager[object]:
        """Hold ``size`` bytes on ``be`` for the block (RESOURCE_EXHAUSTED when they are not free)."""
        ...


class Snapshots:
    """Snapshot and group-snapshot operations over the store, the locks and the manager's :class:`VolumeAccess`."""

    def __init__(self, store: StateStore, locks: OperationLocks, volumes: VolumeAccess) -> None:
        self.store = store
        self.locks = locks
        self.volumes = volumes

    # ------------------------------------------------------------ consistency

    @contextlib.contextmanager
    def frozen(self, volumes: list[Volume]) -> Iterator[None]:
        """Freeze the staged, mounted ext4/xfs filesystems among ``volumes`` for the block."""
        points = []
        for v in volumes:
            stage = self.store.get_stage(v.volume_id)
            if stage is None or v.is_subvolume:
                continue
            if v.is_block:
                if stage.device:  # no filesystem to freeze: at least push the device's buffered writes to the file
                    fileops.flush_device(stage.device)
            elif holders.mounted(v, Path(v.path), stage.staging_path):  # this volume's filesystem, not just any
                points.append(stage.staging_path)
        with fileops.frozen(points):
            yield

    def thaw_all(self) -> list[str]:
        """Thaw every staged filesystem; return the staging paths that were frozen.

        A snapshot freezes a staged filesystem only while it copies, but an agent killed in that moment leaves it
        frozen and every writer in the pod blocked: the plugin calls this once at start, before serving.
        """
        thawed = []
        for rec in self.store.list_stages():
            v = self.store.get_volume(rec.volume_id)
            if v is None or v.is_block or v.is_subvolume or not holders.mounted(v, Path(v.path), rec.staging_path):
                continue
            if fileops.thaw(rec.staging_path):
                _log.warning("thawed a filesystem left frozen", volume_id=v.volume_id, staging=rec.staging_path)
                thawed.append(rec.staging_path)
        return thawed

    def _in_use(self, v: Volume) -> bool:
        stage = self.store.get_stage(v.volume_id)
        return bool(stage and (v.is_block or v.is_subvolume or mounts.is_mounted(stage.staging_path)))

    # ------------------------------------------------------------ snapshots

    def create_snapshot(self, name: str, source_volume_id: str, parameters: Mapping[str, str]) -> Snapshot:
        validate_name("name", name)
        if not source_volume_id:
            raise InvalidArgument("source_volume_id: required field is missing")
        takes_no_parameters(parameters, "snapshots")
        with self.locks.hold(f"snapname/{name}"):
            existing = self.store.get_snapshot_by_name(name)
            if existing is not None:
                if existing.source_volume_id != source_volume_id:
                    raise AlreadyExists(
                        f"snapshot {name!r} already exists as {existing.snapshot_id} of volume "
                        f"{existing.source_volume_id}, not of {source_volume_id}"
                    )
                return existing
            try:
                v = self.volumes.volume(source_volume_id, "source_volume_id")
            except InvalidArgument:
                raise NotFound(f"source_volume_id: volume {source_volume_id!r} does not exist") from None
            sid = derive_id("snap", name)
            with self.locks.hold(f"volume/{v.volume_id}", f"snapshot/{sid}"):
                snap = self._cut([v], [(sid, name)], "")[0]
                try:
                    self.store.put_snapshot(snap)
                except BaseException:
                    self.volumes.backend(snap.backend).delete_snapshot(snap)
                    raise
        _log.info("snapshot created", snapshot_id=sid, volume_id=v.volume_id, bytes=snap.size_bytes)
        return snap

    def _cut(self, vols: list[Volume], ids: list[tuple[str, str]], group_id: str) -> list[Snapshot]:
        """Snapshot ``vols`` (frozen together) as ``ids`` [(snapshot_id, name)]; undo all on failure."""
        need: dict[str, int] = {}  # bytes a copy may take, per backend (a subvolume snapshot shares everything)
        for v in vols:
            need[v.backend] = need.get(v.backend, 0) + (0 if v.is_subvolume else fileops.allocated_bytes(v.path))
        done: list[Snapshot] = []
        try:
            with contextlib.ExitStack() as space:
                for bname, nbytes in need.items():  # never into space promised to volumes
                    space.enter_context(self.volumes.reserve(self.volumes.backend(bname), nbytes, count=False))
                with self.frozen(vols):
                    now = time.time()
                    for v, (sid, name) in zip(vols, ids, strict=True):
                        path, size = self.volumes.backend(v.backend).snapshot(sid, v)
                        done.append(
                            Snapshot(
                                snapshot_id=sid,
                                name=name,
                                source_volume_id=v.volume_id,
                                size_bytes=size,
                                path=path,
                                created_at=now,
                                group_snapshot_id=group_id,
                                backend=v.backend,
                                access_type=v.access_type,
                                fs_type=v.fs_type,
                            )
                        )
        except BaseException:
            for s in done:
                with contextlib.suppress(Exception):
                    self.volumes.backend(s.backend).delete_snapshot(s)
            raise
        return done

    def delete_snapshot(self, snapshot_id: str) -> None:
        if not issued("snapshot_id", snapshot_id):
            return
        with self.locks.hold(f"snapshot/{snapshot_id}"):
            s = self.store.get_snapshot(snapshot_id)
            if s is None:
                return
            if s.group_snapshot_id and self.store.get_group_snapshot(s.group_snapshot_id):
                raise FailedPrecondition(
                    f"snapshot {snapshot_id} belongs to group snapshot {s.group_snapshot_id}: delete the group"
                )
            self.volumes.backend(s.backend or "loopfile", "snapshot.backend").delete_snapshot(s)
            self.store.delete_snapshot(snapshot_id)
        _log.info("snapshot deleted", snapshot_id=snapshot_id)

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        validate_id("snapshot_id", snapshot_id)
        s = self.store.get_snapshot(snapshot_id)
        if s is None:
            raise NotFound(f"snapshot {snapshot_id} does not exist")
        return s

    def list_snapshots(
        self, max_entries: int = 0, starting_token: str = "", source_volume_id: str = "", snapshot_id: str = ""
    ) -> tuple[list[Snapshot], str]:
        if max_entries < 0:
            raise InvalidArgument(f"max_entries: expected a value >= 0, got {max_entries}")
        if snapshot_id:
            s = self.store.get_snapshot(snapshot_id)
            if s is None or (source_volume_id and s.source_volume_id != source_volume_id):
                return [], ""
            return [s], ""
        return self.store.list_snapshots(max_entries, starting_token, source_volume_id=source_volume_id)

    # ------------------------------------------------------------ group snapshots

    def create_group_snapshot(
        self, name: str, source_volume_ids: list[str], parameters: Mapping[str, str]
    ) -> tuple[GroupSnapshot, list[Snapshot]]:
        validate_name("name", name)
        if not source_volume_ids:
            raise InvalidArgument("source_volume_ids: required field is missing")
        if len(set(source_volume_ids)) != len(source_volume_ids):
            raise InvalidArgument("source_volume_ids: a volume is listed twice")
        takes_no_parameters(parameters, "group snapshots")
        with self.locks.hold(f"groupname/{name}"):
            existing = self.store.get_group_snapshot_by_name(name)
            if existing is not None:
                members = self._members(existing)
                if sorted(s.source_volume_id for s in members) != sorted(source_volume_ids):
                    raise AlreadyExists(
                        f"group snapshot {name!r} already exists as {existing.group_snapshot_id} of other volumes"
                    )
                return existing, members
            vols = [self.volumes.volume(i, f"source_volume_ids[{n}]") for n, i in enumerate(source_volume_ids)]
            if len(vols) > 1:
                for v in vols:
                    if (v.is_block or v.is_subvolume) and self._in_use(v):
                        raise FailedPrecondition(
                            f"volume {v.volume_id} is staged as a {'block volume' if v.is_block else 'btrfs subvolume'}"
                            " and cannot be frozen, so it cannot be snapshotted together with other volumes: "
                            "unstage it or snapshot it alone"
                        )
            gid = derive_id("group", name)
            ids = [(derive_id("snap", f"{gid}/{v.volume_id}"), f"{gid}/{v.volume_id}") for v in vols]
            keys = [f"volume/{v.volume_id}" for v in vols]
            with self.locks.hold(*keys):
                snaps = self._cut(vols, ids, gid)
            group = GroupSnapshot(
                group_snapshot_id=gid,
                name=name,
                snapshot_ids=tuple(s.snapshot_id for s in snaps),
                created_at=snaps[0].created_at,
            )
            try:
                self.store.put_group_snapshot(group, snaps)
            except BaseException:
                for s in snaps:
                    with contextlib.suppress(Exception):
                        self.volumes.backend(s.backend).delete_snapshot(s)
                raise
        _log.info("group snapshot created", group_snapshot_id=gid, snapshots=len(snaps))
        return group, snaps

    def _members(self, g: GroupSnapshot) -> list[Snapshot]:
        return [s for s in (self.store.get_snapshot(i) for i in g.snapshot_ids) if s is not None]

    def _check_members(self, g: GroupSnapshot, snapshot_ids: list[str]) -> None:
        """The caller's member list must be the group's (checked once the group is known to exist)."""
        if not snapshot_ids:
            raise InvalidArgument("snapshot_ids: required field is missing")
        if sorted(snapshot_ids) != sorted(g.snapshot_ids):
            raise InvalidArgument(
                f"snapshot_ids: group snapshot {g.group_snapshot_id} holds {sorted(g.snapshot_ids)}, "
                f"got {sorted(snapshot_ids)}"
            )

    def delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids: list[str]) -> None:
        if not issued("group_snapshot_id", group_snapshot_id):
            return
        with self.locks.hold(f"group/{group_snapshot_id}"):
            g = self.store.get_group_snapshot(group_snapshot_id)
            if g is None:
                return
            self._check_members(g, snapshot_ids)
            for s in self._members(g):
                self.volumes.backend(s.backend or "loopfile", "snapshot.backend").delete_snapshot(s)
            self.store.delete_group_snapshot(group_snapshot_id)
            for sid in g.snapshot_ids:
                self.store.delete_snapshot(sid)
        _log.info("group snapshot deleted", group_snapshot_id=group_snapshot_id)

    def get_group_snapshot(
        self, group_snapshot_id: str, snapshot_ids: list[str]
    ) -> tuple[GroupSnapshot, list[Snapshot]]:
        if not issued("group_snapshot_id", group_snapshot_id):
            raise NotFound(f"group snapshot {group_snapshot_id[:128]!r} does not exist")
        g = self.store.get_group_snapshot(group_snapshot_id)
        if g is None:
            raise NotFound(f"group snapshot {group_snapshot_id} does not exist")
        self._check_members(g, snapshot_ids)
        return g, self._members(g)
