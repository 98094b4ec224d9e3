"""The volume manager: the CSI core's one entry point for volumes, snapshots and group snapshots.

Constructed by the plugin as::

    store = StateStore(ctx.root(config.data_dir) / "state.db")
    manager = VolumeManager(store, config, root=ctx.root)

Every method is synchronous (it runs mkfs, cp, btrfs ...); servicers call it through ``asyncio.to_thread``. Errors
are :mod:`csi.errors` subclasses. ``manager.locks`` is the one :class:`OperationLocks` shared by the Controller and
Node services: hold ``volume/<id>`` around any operation that changes a volume's host state (the manager holds
``name/<name>``, ``volume/<id>``, ``snapshot/<id>`` and ``group/<name>`` itself).

Idempotency and crash safety: ids are derived from the CO's names (``vol-``/``snap-``/``group-`` + 32 hex digits of
SHA-256), so a retry after a crash lands on the same id and the backend clears what the interrupted attempt left
(never-recorded temp files or subvolumes). A volume is recorded only after its bytes are complete, and its bytes are
removed only after it is no longer staged or published. The state store is the truth for what exists; a backing
file that went missing is reported by :meth:`volume_condition`, never silently recreated.

Snapshots and group snapshots (and how they stay consistent) are ``manager.snapshots``, a
:class:`csi.snapshots.Snapshots` that reaches volumes, backends and free space through the manager's
:meth:`volume`, :meth:`backend` and :meth:`reserve`.

At start, before serving, the plugin calls ``manager.snapshots.thaw_all()`` (a filesystem left frozen by a crash
mid-snapshot) and reports :meth:`unrecorded` (files or subvolumes no record names; never deleted automatically).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from csi import capacity, offlinegrow
from csi.backends import Backend, fileops
from csi.backends.btrfs import BtrfsBackend
from csi.backends.loopfile import LoopfileBackend
from csi.capacity import CapacityRange as CapacityRange  # re-exported: part of the manager API
from csi.config import TOPOLOGY_KEY, Config
from csi.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange, ResourceExhausted
from csi.locks import OperationLocks
from csi.model import (
    BACKENDS,
    AccessType,
    Condition,
    Snapshot,
    Volume,
    VolumeSource,
    derive_id,
    issued,
    validate_id,
    validate_name,
)
from csi.model import (
    Backend as BackendName,
)
from csi.snapshots import PASSTHROUGH_PREFIXES, Snapshots
from csi.state import StateStore
from nodeplug.log import get_logger
from nodeplug.paths import Root

_log = get_logger("csi")

PARAM_BACKEND = "backend"

Record = Callable[[Callable[[], object]], None]  # records a reserved volume and releases its hold (reserve)


@dataclass(frozen=True)
class _Plan:
    """A CreateVolume request resolved: backend chosen, filesystem defaulted, id derived from the name."""

    name: str
    volume_id: str
    capacity: CapacityRange
    access_type: AccessType
    fs_type: str
    backend: Backend
    parameters: Mapping[str, str]
    source: VolumeSource | None
    ephemeral: bool


class VolumeManager:
    """Volumes over the state store and the backends; snapshots through its collaborator ``snapshots``."""

    def __init__(self, store: StateStore, config: Config, root: Root | None = None) -> None:
        self.store = store
        self.config = config
        self.root = root or Root()
        self.locks = OperationLocks()
        # Free space is checked, held and recorded under this lock (see :meth:`reserve`); a reader holding it sees
        # every volume counted once, as recorded or as held for a create in flight.
        self.space = threading.Lock()
        self._reserved: dict[str, int] = {}
        self._in_flight = 0
        self.data_dir = self.root(config.data_dir)
        self.backends: dict[str, Backend] = {
            "loopfile": LoopfileBackend(self.data_dir, reserved_bytes=config.reserved_bytes),
        }
        if config.btrfs.enabled:
            self.backends["btrfs"] = BtrfsBackend(
                self.root(config.btrfs.path), config.btrfs.subdir, reserved_bytes=config.reserved_bytes
            )
        self.snapshots = Snapshots(store, self.locks, self)

    @property
    def node_id(self) -> str:
        return self.config.node_id or socket.gethostname()

    @property
    def topology(self) -> dict[str, str]:
        return {TOPOLOGY_KEY: self.node_id}

    def backing_path(self, volume: Volume) -> Path:
        """The backing file (loop-file volumes) or subvolume directory of ``volume``."""
        return Path(volume.path)

    # ------------------------------------------------------------ helpers

    def backend(self, name: str, what: str = "parameters.backend") -> Backend:
        """The enabled backend called ``name``; INVALID_ARGUMENT (unknown) or FAILED_PRECONDITION (not enabled)."""
        if name not in BACKENDS:
            raise InvalidArgument(f"{what}: expected one of {', '.join(BACKENDS)}, got {name!r}")
        b = self.backends.get(name)
        if b is None:
            raise FailedPrecondition(f"{what}: the {name} backend is not enabled on this node (csi.btrfs.enabled)")
        return b

    def _resolve_backend(self, backend: str, parameters: Mapping[str, str]) -> str:
        for key in parameters:
            if key != PARAM_BACKEND and not key.startswith(PASSTHROUGH_PREFIXES):
                raise InvalidArgument(f"parameters.{key}: unknown parameter (supported: {PARAM_BACKEND})")
        return backend or parameters.get(PARAM_BACKEND, "") or self.config.default_backend

    def volume(self, volume_id: str, field: str = "volume_id") -> Volume:
        """The recorded volume ``volume_id``; NOT_FOUND (INVALID_ARGUMENT for an id this driver never issues)."""
        validate_id(field, volume_id)
        v = self.store.get_volume(volume_id)
        if v is None:
            raise NotFound(f"volume {volume_id} does not exist")
        return v

    def unrecorded(self) -> list[Path]:
        """Volume and snapshot files or subvolumes in the backends' directories that no record names.

        What an interrupted create left behind, or what was put there by hand. Reported (by the plugin's reconcile
        and the doctor), never deleted here: a retry of the same create replaces its own leftover.
        """
        known = {v.path for v in self.store.list_volumes()[0]} | {s.path for s in self.store.list_snapshots()[0]}
        found: list[Path] = []
        for be in self.backends.values():
            for sub in ("volumes", "snapshots"):
                d = be.base / sub
                try:
                    entries = sorted(d.iterdir())
                except OSError:
                    continue
                found += [p for p in entries if str(p) not in known]
        return found

    # ------------------------------------------------------------ volumes

    def create_volume(
        self,
        name: str,
        *,
        capacity_range: CapacityRange,
        access_type: str,
        fs_type: str = "",
        backend: str = "",
        parameters: Mapping[str, str] | None = None,
        source: VolumeSource | None = None,
        ephemeral: bool = False,
    ) -> Volume:
        """Create (or return the existing, compatible) volume called ``name``.

        ``backend`` "" means ``parameters["backend"]`` or the configured default; ``fs_type`` "" means the backend's
        default (ext4/xfs from config; ``btrfs`` — a subvolume — on the btrfs backend); ignored for block volumes.
        """
        validate_name("name", name)
        if access_type not in ("mount", "block"):
            raise InvalidArgument(f"volume_capabilities: access type must be mount or block, got {access_type!r}")
        parameters = dict(parameters or {})
        be = self.backend(self._resolve_backend(backend, parameters))
        if access_type == "block":
            fs_type = ""
        elif not fs_type:
            fs_type = "btrfs" if be.name == "btrfs" else self.config.default_fs_type
        why = be.supports(access_type, fs_type)
        if why:
            raise InvalidArgument(f"volume_capabilities.mount.fs_type: {why}")
        capacity.check_range(capacity_range.required_bytes, capacity_range.limit_bytes)
        plan = _Plan(
            name=name,
            volume_id=derive_id("vol", name),
            capacity=capacity_range,
            access_type=cast(AccessType, access_type),
            fs_type=fs_type,
            backend=be,
            parameters=parameters,
            source=source,
            ephemeral=ephemeral,
        )
        with self.locks.hold(f"name/{name}"):
            existing = self.store.get_volume_by_name(name)
            if existing is not None:
                return self._compatible(existing, plan)
            source_key = f"{source.kind}/{source.id}" if source else ""
            with self.locks.hold(f"volume/{plan.volume_id}", source_key):
                return self._create(plan)

    def _compatible(self, v: Volume, plan: _Plan) -> Volume:
        diffs = []
        req, lim = plan.capacity.required_bytes, plan.capacity.limit_bytes
        if (req and v.capacity_bytes < req) or (lim and v.capacity_bytes > lim):
            diffs.append(f"capacity {v.capacity_bytes} is outside [{req}, {lim}]")
        if v.access_type != plan.access_type:
            diffs.append(f"access type is {v.access_type}")
        if v.access_type == "mount" and v.fs_type != plan.fs_type:
            diffs.append(f"fs type is {v.fs_type}")
        if v.backend != plan.backend.name:
            diffs.append(f"backend is {v.backend}")
        src = plan.source
        want_snap = src.id if src and src.kind == "snapshot" else ""
        want_vol = src.id if src and src.kind == "volume" else ""
        if (v.source_snapshot_id, v.source_volume_id) != (want_snap, want_vol):
            diffs.append("content source differs")
        if diffs:
            raise AlreadyExists(f"volume {v.name!r} already exists as {v.volume_id} but its " + ", ".join(diffs))
        return v

    def _create(self, plan: _Plan) -> Volume:
        be, vid, access_type, fs_type = plan.backend, plan.volume_id, plan.access_type, plan.fs_type
        snap: Snapshot | None = None
        src_vol: Volume | None = None
        source_size = 0
        if plan.source is not None:
            snap, src_vol = self._source(plan.source, be.name, access_type, fs_type)
            source_size = snap.size_bytes if snap else cast(Volume, src_vol).capacity_bytes
        minimum = fileops.min_fs_bytes(fs_type) if access_type == "mount" and fs_type != "btrfs" else capacity.UNIT
        size = capacity.volume_size(plan.capacity.required_bytes, plan.capacity.limit_bytes, minimum, source_size)
        be.ready()
        with self.reserve(be, size) as record:  # held until the volume is recorded and counts by itself
            if snap is not None:
                path = be.create_from_snapshot(vid, size, snap)
            elif src_vol is not None:
                with self.snapshots.frozen([src_vol]):
                    path = be.clone(vid, size, src_vol)
            else:
                path = be.create(vid, size, access_type, fs_type)
            vol = Volume(
                volume_id=vid,
                name=plan.name,
                capacity_bytes=size,
                backend=cast(BackendName, be.name),
                access_type=access_type,
                fs_type=fs_type,
                path=path,
                source_snapshot_id=snap.snapshot_id if snap else "",
                source_volume_id=src_vol.volume_id if src_vol else "",
                parameters=dict(plan.parameters),
                ephemeral=plan.ephemeral,
                created_at=time.time(),
            )
            try:
                record(lambda: self.store.put_volume(vol))
            except BaseException:
                be.delete(vol)
                raise
        _log.info("volume created", volume_id=vid, backend=be.name, bytes=size, access=access_type, fs=fs_type or None)
        return vol

    def _source(
        self, source: VolumeSource, bname: str, access_type: str, fs_type: str
    ) -> tuple[Snapshot | None, Volume | None]:
        field = "volume_content_source." + ("snapshot.snapshot_id" if source.kind == "snapshot" else "volume.volume_id")
        try:
            validate_id(field, source.id)
        except InvalidArgument:
            raise NotFound(f"{field}: {source.kind} {source.id!r} does not exist") from None
        shape: tuple[str, str, str]
        snap, vol = None, None
        if source.kind == "snapshot":
            snap = self.store.get_snapshot(source.id)
            if snap is None:
                raise NotFound(f"{field}: snapshot {source.id} does not exist")
            shape = (snap.backend, snap.access_type, snap.fs_type)
        else:
            vol = self.store.get_volume(source.id)
            if vol is None:
                raise NotFound(f"{field}: volume {source.id} does not exist")
            shape = (vol.backend, vol.access_type, vol.fs_type)
        if shape != (bname, access_type, fs_type):
            raise InvalidArgument(
                f"{field}: the source is a {shape[1]} volume ({shape[2] or 'raw'}) on the {shape[0]} backend; the new "
                f"volume must match it, got {access_type} ({fs_type or 'raw'}) on {bname}"
            )
        return snap, vol

    def delete_volume(self, volume_id: str) -> None:
        """Delete a volume; one that does not exist (or an id this driver never issues) is already deleted."""
        if not issued("volume_id", volume_id):
            return
        v = self.store.get_volume(volume_id)
        if v is None:
            return
        with self.locks.hold(f"volume/{volume_id}", f"name/{v.name}"):
            v = self.store.get_volume(volume_id)
            if v is None:
                return
            pubs = self.store.list_publishes(volume_id)
            if pubs:
                raise FailedPrecondition(f"volume {volume_id} is still published at {pubs[0].target_path}")
            stage = self.store.get_stage(volume_id)
            if stage is not None:
                raise FailedPrecondition(f"volume {volume_id} is still staged at {stage.staging_path}")
            self.backend(v.backend, "volume.backend").delete(v)
            self.store.delete_volume(volume_id)
            with contextlib.suppress(FileNotFoundError):  # an interrupted grow's, kept for its next stage
                self.grow_marker(volume_id).unlink()
        _log.info("volume deleted", volume_id=volume_id)

    def grow_marker(self, volume_id: str) -> Path:
        """The marker of an offline grow of the volume's filesystem under way (:mod:`csi.offlinegrow`)."""
        return offlinegrow.marker_path(self.data_dir / "grow", volume_id)

    def get_volume(self, volume_id: str) -> Volume:
        return self.volume(volume_id)

    def list_volumes(self, max_entries: int = 0, starting_token: str = "") -> tuple[list[Volume], str]:
        if max_entries < 0:
            raise InvalidArgument(f"max_entries: expected a value >= 0, got {max_entries}")
        return self.store.list_volumes(max_entries, starting_token)

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int = 0) -> tuple[int, bool]:
        """Grow a volume; return (new capacity, whether NodeExpandVolume must follow). Never shrinks."""
        v = self.volume(volume_id)
        with self.locks.hold(f"volume/{volume_id}"):
            v = self.volume(volume_id)
            be = self.backend(v.backend, "volume.backend")
            size = capacity.expanded_size(v.capacity_bytes, required_bytes, limit_bytes)
            node_needed = not v.is_subvolume
            if size == v.capacity_bytes:
                return size, node_needed
            try:
                with self.reserve(be, size - v.capacity_bytes, count=False) as record:
                    node_needed = be.expand(v, size)
                    record(lambda: self.store.put_volume(replace(v, capacity_bytes=size)))
            except ResourceExhausted as e:
                raise OutOfRange(f"capacity_range.required_bytes: growing {volume_id} to {size}: {e}") from None
        _log.info("volume expanded", volume_id=volume_id, bytes=size, node_expansion=node_needed)
        return size, node_needed

    def get_capacity(self, parameters: Mapping[str, str], topology: Mapping[str, str] | None = None) -> int:
        """Bytes a new volume with ``parameters`` may take here; 0 for a topology this node is not in."""
        if topology:
            for key, value in topology.items():
                if key != TOPOLOGY_KEY or value != self.node_id:
                    return 0
        if self._full():
            return 0
        try:
            be = self.backend(self._resolve_backend("", parameters))
            be.ready()
        except FailedPrecondition as e:  # not enabled, or not usable (e.g. btrfs.path is not btrfs): nothing here
            _log.warning("backend unavailable for GetCapacity", error=str(e))
            return 0
        with self.space:
            return max(0, self._free(be))

    def reserved(self, backend: str) -> int:
        """Bytes of ``backend`` held for creates and expansions in flight (see :meth:`reserve`)."""
        return self._reserved.get(backend, 0)

    def _full(self) -> bool:
        """True when ``max_volumes_per_node`` volumes are recorded or being created."""
        limit = self.config.max_volumes_per_node
        return bool(limit) and self.store.count_volumes() + self._in_flight >= limit

    def _free(self, be: Backend) -> int:
        """Bytes ``be`` can still give that neither recorded volumes nor creates in flight (:meth:`reserve`) may take;
        call under ``self.space``."""
        return be.free_bytes(self.store.list_volumes()[0]) - self._reserved.get(be.name, 0)

    @contextlib.contextmanager
    def reserve(self, be: Backend, size: int, count: bool = True) -> Iterator[Record]:
        """Check and hold ``size`` bytes (and a volume slot) on a backend while it is being filled.

        Free space counts recorded volumes only, so without this two concurrent creates could each see the same
        free bytes; the check and the reservation happen under one lock, the slow work outside it. The body ends
        by recording its volume through the ``record`` it is given: the store write and the release happen under
        the same lock, so no other create ever sees the volume counted twice (as recorded and as reserved) and is
        refused space that is there. Without a record (failure, or nothing to record) the hold ends with the body.
        """
        with self.space:
            if count and self._full():
                limit = self.config.max_volumes_per_node
                raise ResourceExhausted(f"this node already holds {limit} volumes (csi.max_volumes_per_node)")
            free = self._free(be)
            if size > free:
                raise ResourceExhausted(f"the {be.name} backend has {max(0, free)} bytes free, {size} are needed")
            self._reserved[be.name] = self._reserved.get(be.name, 0) + size
            self._in_flight += int(count)
        held = True

        def release() -> None:
            nonlocal held
            if held:
                self._reserved[be.name] -= size
                self._in_flight -= int(count)
                held = False

        def record(write: Callable[[], object]) -> None:
            with self.space:
                write()
                release()

        try:
            yield record
        finally:
            with self.space:
                release()

    def volume_condition(self, volume_id: str, quick: bool = False) -> Condition:
        """Abnormal, with a message, when the volume's bytes are missing or its filesystem records errors.

        ``quick`` only checks that the backing file or subvolume is there (for listing many volumes).
        """
        v = self.volume(volume_id)
        try:
            be = self.backend(v.backend, "volume.backend")
        except FailedPrecondition as e:
            return Condition(True, str(e))
        if quick:
            ok = Path(v.path).is_dir() if v.is_subvolume else Path(v.path).is_file()
            return Condition(not ok, "volume is present" if ok else f"{v.path} is missing")
        problem = be.condition(v)
        return Condition(bool(problem), problem or "volume is healthy")
