"""Host work behind the Node service: loop devices, formatting, mounts, records. Synchronous, one volume at a time.

:class:`csi.node.NodeServicer` validates requests (paths in kubelet's shapes, acceptable flags) and holds the volume's
lock; :class:`NodeHost` does the work in a worker thread. Every step first looks at the host (mount table, attached
loop devices) and only then acts, so a repeated or interrupted call converges instead of failing: a stage after a
reboot re-attaches the loop device and re-mounts; an unpublish of a target that is already gone just tidies the
record.

Ours, or hands off. A mount found at a staging or target path is adopted by a repeat call, or unmounted, only when
the kernel says it holds this volume (:func:`csi.holders.holds`); another volume's or anybody's mount there is
refused (ALREADY_EXISTS) or, on the way down, left alone. A target is removed on unpublish only when the publish
record says the driver created it.

All or nothing. A stage or publish that fails undoes what it did (the loop device it attached, the mount it made,
the target it created) before the error goes back, so a refused request leaves the host as it found it. Mount
options the filesystem rejects are INVALID_ARGUMENT: a stage that fails with options is tried once without them,
and if that works the options were at fault.

Records kept (in the volume manager's SQLite store): a stage record per staged volume (staging path, device) and a
publish record per target (and whether the driver created it). They are written after the host change succeeds;
the host state found on a repeat call is adopted, so a kill -9 between the change and the record loses nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from csi import holders, loopdev, mounts, offlinegrow
from csi.backends import fileops
from csi.errors import AlreadyExists, FailedPrecondition, Internal, InvalidArgument, NotFound
from csi.model import PublishRecord, StageRecord, Volume, validate_id
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.commands import CommandError, run
from nodeplug.log import Logger, get_logger

EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
DEFAULT_EPHEMERAL_BYTES = 100 << 20
# Per-mount flags a bind remount can change; filesystem options (discard, nouuid, ...) apply at stage only.
PER_MOUNT_FLAGS = frozenset({"nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime", "strictatime"})
FS_TIMEOUT = 300.0
_SIZE_RE = re.compile(r"([0-9]{1,20})\s*(|k|Ki|M|Mi|G|Gi|T|Ti)", re.ASCII)  # ASCII digits, few enough for int()
_UNITS = {"": 1, "k": 10**3, "Ki": 1 << 10, "M": 10**6, "Mi": 1 << 20, "G": 10**9, "Gi": 1 << 30}
_UNITS |= {"T": 10**12, "Ti": 1 << 40}


@dataclass(frozen=True)
class StageSpec:
    volume_id: str
    staging: Path
    kind: str  # "mount" | "block"
    fs_type: str
    flags: tuple[str, ...]


@dataclass(frozen=True)
class PublishSpec:
    volume_id: str
    target: Path
    staging: Path | None
    kind: str
    fs_type: str
    flags: tuple[str, ...]
    readonly: bool
    single_target: bool
    ephemeral: bool = False
    context: Mapping[str, str] = field(default_factory=dict)


def parse_size(text: str) -> int:
    m = _SIZE_RE.fullmatch(text.strip(" \t\r\n"))  # ASCII blanks only: str.strip() also takes "\xa0"
    if not m:
        raise InvalidArgument(f"volume_context.size: expected a size such as 64Mi or 1Gi, got {text[:64]!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def fs_type_of(device: str) -> str:
    """The filesystem signature on ``device`` ("" when blank)."""
    try:
        return run(["blkid", "-p", "-o", "value", "-s", "TYPE", device], 30).strip()
    except CommandError as e:
        if e.returncode == 2:  # nothing found: a blank device
            return ""
        raise Internal.from_command(e, f"probing {device}") from e


def _remove_created(target: Path) -> None:
    """Remove a target the driver created: its (empty) directory or its (empty) device-node placeholder file."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    with contextlib.suppress(OSError):  # not empty any more, or replaced: then it is not ours to remove
        if stat.S_ISDIR(st.st_mode):
            target.rmdir()
        elif stat.S_ISREG(st.st_mode) and st.st_size == 0:
            target.unlink()


class NodeHost:
    def __init__(self, manager: VolumeManager, ephemeral_dir: Path, log: Logger | None = None) -> None:
        self.manager = manager
        self.store = manager.store
        self.ephemeral_dir = ephemeral_dir
        self.log = log or get_logger("csi")

    # ------------------------------------------------------------ lookups

    def volume(self, volume_id: str) -> Volume:
        """The volume with this id, or the ephemeral volume kubelet calls by this name; NotFound otherwise."""
        try:
            return self.manager.get_volume(volume_id)
        except NotFound:
            v = self.ephemeral_of(volume_id)
            if v is None:
                raise
            return v

    def ephemeral_of(self, volume_id: str) -> Volume | None:
        """The ephemeral volume kubelet calls ``volume_id`` (our volume's name), if this is one."""
        if self.store.get_volume(volume_id) is not None:
            return None
        v = self.store.get_volume_by_name(volume_id)
        return v if v is not None and v.ephemeral else None

    def backing(self, v: Volume) -> Path:
        return self.manager.backing_path(v)

    def grow_marker(self, v: Volume) -> Path:
        """The marker of an offline grow of ``v``'s filesystem under way (:mod:`csi.offlinegrow`)."""
        return self.manager.grow_marker(v.volume_id)

    # ------------------------------------------------------------ stage

    def stage(self, spec: StageSpec) -> None:
        v = self.volume(spec.volume_id)
        self.check_kind(v, spec.kind, spec.fs_type)
        rec = self.store.get_stage(v.volume_id)
        if rec is not None and rec.staging_path != str(spec.staging):
            raise FailedPrecondition(
                f"volume {v.volume_id} is already staged at {rec.staging_path}; unstage it before staging elsewhere"
            )
        backing = self.backing(v)
        if not backing.exists():
            raise FailedPrecondition(f"volume {v.volume_id}: its backing {backing} is missing; the data is gone")
        entry = None if v.is_block else mounts.find_mount(spec.staging)  # a block volume mounts nothing there
        if entry is not None:  # staged already (a repeat, or a restart): only if that mount is this volume
            if not holders.holds(v, backing, spec.staging):
                raise AlreadyExists(
                    f"staging_target_path {spec.staging}: {entry.source} ({entry.fs_type}) is mounted there, "
                    f"not volume {v.volume_id}"
                )
            missing = [f for f in spec.flags if f in PER_MOUNT_FLAGS | {"ro"} and f not in entry.options]
            if missing:
                raise AlreadyExists(f"volume {v.volume_id} is staged at {spec.staging} without mount flags {missing}")
            device = "" if v.is_subvolume else (loopdev.rw_device(backing) or "")
            self._record_stage(rec, StageRecord(v.volume_id, str(spec.staging), device))
        else:
            with contextlib.ExitStack() as undo:  # a failure anywhere takes back what this call did
                undo.callback(fileops.remove_dirs, fileops.make_dirs(spec.staging))
                device = self._stage_on_host(v, spec, undo)
                self._record_stage(rec, StageRecord(v.volume_id, str(spec.staging), device))
                undo.pop_all()
        self.log.info("staged", volume_id=v.volume_id, staging=str(spec.staging), device=device or None)

    def _record_stage(self, had: StageRecord | None, rec: StageRecord) -> None:
        if had != rec:
            self.store.put_stage(rec)

    def _stage_on_host(self, v: Volume, spec: StageSpec, undo: contextlib.ExitStack) -> str:
        """Attach and mount (nothing is at the staging path yet); every step pushes its undo onto ``undo``."""
        backing = self.backing(v)
        if v.is_subvolume:
            self._mount(v, spec, lambda flags: mounts.bind_mount(backing, spec.staging, False, flags))
            undo.callback(mounts.unmount_top, spec.staging)
            return ""
        device, attached = loopdev.attach(backing)
        if attached:
            undo.callback(loopdev.detach, device)
        else:  # attached before (a restart): it may not know its file grew since
            loopdev.refresh_size(device)
        if v.is_block:
            return device
        fs = v.fs_type or "ext4"  # the volume's, never the request's (an unchecked name would pick the mkfs run)
        marker = self.grow_marker(v)
        if fs == "ext4" and offlinegrow.interrupted(marker):  # a grow killed half-way: repaired before any read
            offlinegrow.grow(Path(device), marker)
            self.log.warning("finished a filesystem growth a kill interrupted", volume_id=v.volume_id)
        have = mounts.fs_size(device, fs)  # the superblock, without spawning blkid in the common case
        if have is None:
            found = fs_type_of(device)
            if not found:  # formatted as at creation (no reserved blocks: the capacity is the user's)
                fileops.mkfs(Path(device), fs)
            elif found != fs:
                raise FailedPrecondition(f"volume {v.volume_id} holds {found}, not {fs}")
            have = mounts.fs_size(device, fs)
        # a volume expanded while unstaged: its device is larger than its filesystem
        grown = have is not None and mounts.block_size(device) - have >= 1 << 20
        if grown and fs == "ext4":  # offline growth needs no CAP_SYS_RESOURCE, unlike the online ioctl
            offlinegrow.grow(Path(device), marker)
        self._mount(v, spec, lambda flags: mounts.mount(device, spec.staging, fs, flags))
        undo.callback(mounts.unmount_top, spec.staging)
        if grown and fs == "xfs":  # xfs grows only while mounted
            fileops.cmd(["xfs_growfs", str(spec.staging)], FS_TIMEOUT, f"growing xfs of {v.volume_id}")
        return device

    def grow_unused(self, v: Volume, staging: Path, device: str) -> bool:
        """Grow ``v``'s ext4 offline while it is staged at ``staging`` and nothing else mounts it (no pod has it
        published): unmount the staging mount, grow (:mod:`csi.offlinegrow`), mount it again with the options it had.
        False, having changed nothing, when anything else mounts the filesystem (the caller grows it online). The
        caller has checked that what ``staging`` shows is ``v`` (:func:`csi.holders.holds`)."""
        table = mounts.mount_table()
        entry = mounts.find_mount(staging, table)
        if entry is None:
            raise FailedPrecondition(f"volume {v.volume_id} is not mounted at {staging}; stage it again")
        if any(e.dev == entry.dev and e.mount_id != entry.mount_id for e in table):
            return False
        options = [o for o in entry.options if o in PER_MOUNT_FLAGS | {"ro"}]
        options += [o for o in entry.super_options if o not in ("rw", "ro")]
        mounts.unmount_top(staging)
        try:
            offlinegrow.grow(Path(device), self.grow_marker(v))
        except offlinegrow.Busy as e:  # mounted elsewhere after all: grown online, as a volume in use is
            self.log.info("not grown offline", volume_id=v.volume_id, reason=str(e))
            return False
        finally:  # staged again whatever happened; a kill before this leaves it to the next NodeStageVolume
            mounts.mount(device, staging, "ext4", options)
        return True

    def _mount(self, v: Volume, spec: StageSpec, do_mount: Callable[[tuple[str, ...]], None]) -> None:
        """Mount with the requested flags; a failure that goes away without them is the flags' (INVALID_ARGUMENT)."""
        try:
            do_mount(spec.flags)
        except CommandError as e:
            if spec.flags and self._mounts_without_flags(spec, do_mount):
                raise InvalidArgument(
                    f"volume_capability.mount.mount_flags: {list(spec.flags)} rejected by the {v.fs_type or 'btrfs'} "
                    f"filesystem of volume {v.volume_id}: {e.stderr.strip() or e}"
                ) from e
            raise Internal.from_command(e, f"mounting volume {v.volume_id}") from e

    @staticmethod
    def _mounts_without_flags(spec: StageSpec, do_mount: Callable[[tuple[str, ...]], None]) -> bool:
        try:
            do_mount(())
        except CommandError:
            return False
        mounts.unmount_top(spec.staging)
        return True

    def _unmount_own(self, v: Volume, path: Path, entry: mounts.MountEntry | None) -> mounts.MountEntry | None:
        """Unmount volume ``v``'s mounts stacked at ``path`` (``entry``: the one on top, just looked up), top first,
        stopping at anything that is not ``v``; return that (None when nothing is mounted there any more)."""
        backing = self.backing(v)
        for _ in range(16):
            if entry is None or not holders.holds(v, backing, path):
                return entry
            mounts.unmount_top(path)
            entry = mounts.find_mount(path)
        raise Internal(f"{path}: still mounted after 16 unmounts")

    def check_kind(self, v: Volume, kind: str, fs_type: str) -> None:
        if kind and (kind == "block") != v.is_block:
            raise FailedPrecondition(
                f"volume {v.volume_id} is a {v.access_type} volume and cannot be used with access type {kind}"
            )
        have = "btrfs" if v.is_subvolume else v.fs_type
        if kind == "mount" and fs_type and have and fs_type != have:
            raise FailedPrecondition(f"volume {v.volume_id} has filesystem {have}, not the requested {fs_type}")

    def unstage(self, volume_id: str, staging: Path) -> None:
        rec = self.store.get_stage(volume_id)
        try:
            v: Volume | None = self.volume(volume_id)
        except NotFound:
            v = None
            if rec is None:
                raise
        if rec is not None and rec.staging_path != str(staging):
            self.log.info("unstage of a path the volume is not staged at: nothing to do", volume_id=volume_id)
            return
        table = mounts.mount_table()  # read once for every question below
        published = self.store.list_publishes(volume_id)
        busy = [p.target_path for p in published if mounts.is_mounted(p.target_path, table)]
        if busy:
            raise FailedPrecondition(f"volume {volume_id} is still published at {busy[0]}; unpublish it first")
        for p in published:  # stale: their targets are no longer mounted
            self.store.delete_publish(volume_id, p.target_path)
        devices: list[str] = []
        if v is not None:
            left = None
            if not v.is_block:  # a block volume mounts nothing at its staging path
                try:
                    left = self._unmount_own(v, staging, mounts.find_mount(staging, table))
                except CommandError as e:
                    raise Internal.from_command(e, f"unmounting the staging path of {volume_id}") from e
            if left is not None:
                self.log.warning(
                    "unstage: the staging path holds a mount that is not this volume's: left alone",
                    volume_id=volume_id,
                    source=left.source,
                )
            # every loop device over the volume's file: the staged one and read-only ones a crash left behind
            devices = [] if v.is_subvolume else [d for d, _ in loopdev.devices_of(self.backing(v))]
            for d in devices:
                loopdev.detach(d)
        if rec is not None:
            self.store.delete_stage(volume_id)
        self.log.info("unstaged", volume_id=volume_id, staging=str(staging), device=",".join(devices) or None)

    # ------------------------------------------------------------ publish

    def publish(self, spec: PublishSpec) -> None:
        v = self.volume(spec.volume_id)
        self.check_kind(v, spec.kind, spec.fs_type)
        rec = self.store.get_stage(v.volume_id)
        if rec is None or (spec.staging is not None and rec.staging_path != str(spec.staging)):
            raise FailedPrecondition(f"volume {v.volume_id} is not staged at {spec.staging}; call NodeStageVolume")
        target = str(spec.target)
        existing = self.store.get_publish(v.volume_id, target)
        table = mounts.mount_table()  # read once for every question below; nothing is changed before they are asked
        entry = mounts.find_mount(spec.target, table)
        if entry is not None:
            if not holders.holds(v, self.backing(v), spec.target):
                raise AlreadyExists(f"target_path {target}: {entry.source} is mounted there, not volume {v.volume_id}")
            self._check_publish_compatible(v, spec, entry, rec, table)
            if existing is None:
                self.store.put_publish(PublishRecord(v.volume_id, target, spec.readonly, rec.staging_path))
            return
        if spec.single_target:
            others = [p.target_path for p in self.store.list_publishes(v.volume_id) if p.target_path != target]
            if [o for o in others if mounts.is_mounted(o, table)]:
                raise FailedPrecondition(
                    f"volume {v.volume_id} is already published at {others[0]} and its access mode allows one target"
                )
        if not v.is_block and not holders.mounted(v, self.backing(v), rec.staging_path, table):
            raise FailedPrecondition(f"volume {v.volume_id} is not mounted at {rec.staging_path}; stage it again")
        flags = [f for f in spec.flags if f in PER_MOUNT_FLAGS]
        with contextlib.ExitStack() as undo:
            created = self._make_target(spec.target, v.is_block)
            if created:
                undo.callback(_remove_created, spec.target)
            try:
                if v.is_block:
                    self._publish_block(v, spec, flags, undo)
                else:
                    mounts.bind_mount(rec.staging_path, spec.target, spec.readonly, flags)
            except CommandError as e:
                raise Internal.from_command(e, f"publishing volume {v.volume_id}") from e
            undo.callback(mounts.unmount_top, spec.target)
            created = created or bool(existing and existing.created)  # made by the driver before a reboot
            self.store.put_publish(
                PublishRecord(
                    volume_id=v.volume_id,
                    target_path=target,
                    readonly=spec.readonly,
                    staging_path=rec.staging_path,
                    created=created,
                )
            )
            undo.pop_all()
        self.log.info("published", volume_id=v.volume_id, target=target, readonly=spec.readonly)

    @staticmethod
    def _make_target(target: Path, block: bool) -> bool:
        """Create the target (a directory, or a file for a block device node to be bound onto); True if this call
        created it. Something of another kind already there is ALREADY_EXISTS."""
        try:
            if block:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640))
            else:
                target.mkdir(mode=0o750)
            return True
        except FileExistsError:
            pass
        except FileNotFoundError as e:
            raise FailedPrecondition(f"target_path {target}: its parent directory does not exist") from e
        st = os.lstat(target)
        if (stat.S_ISREG(st.st_mode) if block else stat.S_ISDIR(st.st_mode)) and not stat.S_ISLNK(st.st_mode):
            return False
        raise AlreadyExists(f"target_path {target}: already exists and is not a {'file' if block else 'directory'}")

    def _publish_block(self, v: Volume, spec: PublishSpec, flags: list[str], undo: contextlib.ExitStack) -> None:
        device = loopdev.rw_device(self.backing(v))
        if device is None:
            raise FailedPrecondition(f"volume {v.volume_id}: its loop device is gone; stage it again")
        if spec.readonly:  # a read-only bind of a device node does not stop writes to the device
            device, _ = loopdev.attach(self.backing(v), read_only=True)
            undo.callback(loopdev.detach, device)
        mounts.bind_mount(device, spec.target, spec.readonly, flags)

    def _check_publish_compatible(
        self,
        v: Volume,
        spec: PublishSpec,
        entry: mounts.MountEntry,
        rec: StageRecord,
        table: Sequence[mounts.MountEntry],
    ) -> None:
        """A repeat publish at a target that already holds this volume (``entry``, from ``table``; ``rec`` its stage
        record): OK only with the same parameters."""
        where = f"volume {v.volume_id} is already published at {spec.target}"
        if entry.readonly != spec.readonly:
            raise AlreadyExists(f"{where} {'read-only' if entry.readonly else 'read-write'}; unpublish it first")
        missing = [f for f in spec.flags if f in PER_MOUNT_FLAGS and f not in entry.options]
        if missing:
            raise AlreadyExists(f"{where} without mount flags {missing}")
        staged = None if v.is_block else mounts.find_mount(rec.staging_path, table)
        inherited = set(staged.options) if staged else set()
        extra = sorted((set(entry.options) & PER_MOUNT_FLAGS) - set(spec.flags) - inherited - {"relatime"})
        if extra:
            raise AlreadyExists(f"{where} with other mount flags {extra}")

    def unpublish(self, volume_id: str, target: Path) -> None:
        rec = self.store.get_publish(volume_id, str(target))
        try:
            v: Volume | None = self.volume(volume_id)
        except NotFound:
            if rec is None:
                raise
            v = None
        entry = mounts.find_mount(target)
        left = entry
        if v is not None and entry is not None:
            # a block publish's device node, when it is this volume's (not this volume: None, and nothing is unmounted)
            ro_device = holders.loop_device_at(v, self.backing(v), target) if v.is_block else None
            if ro_device is not None and not loopdev.is_read_only(ro_device):
                ro_device = None  # the staged device: it stays attached until unstage
            try:
                left = self._unmount_own(v, target, entry)
            except CommandError as e:
                raise Internal.from_command(e, f"unmounting {target}") from e
            if ro_device is not None:
                loopdev.detach(ro_device)
        if left is not None:  # not this volume there (any more): nothing of anybody's is touched
            self.log.warning(
                "unpublish: the target holds a mount that is not this volume's: left alone",
                volume_id=volume_id,
                target=str(target),
                source=left.source,
            )
        elif rec is not None and rec.created:
            _remove_created(target)
        if rec is not None:
            self.store.delete_publish(volume_id, str(target))
        self.log.info("unpublished", volume_id=volume_id, target=str(target))

    # ------------------------------------------------------------ ephemeral inline volumes

    def publish_ephemeral(self, spec: PublishSpec) -> None:
        ctx = dict(spec.context)
        size = parse_size(ctx["size"]) if "size" in ctx else DEFAULT_EPHEMERAL_BYTES
        params = {k: val for k, val in ctx.items() if not k.startswith("csi.storage.k8s.io/") and k != "size"}
        backend = params.pop("backend", "")
        fs = spec.fs_type or params.pop("fsType", "")
        kind = spec.kind or "mount"
        is_new = self.store.get_volume_by_name(spec.volume_id) is None
        try:
            v = self.manager.create_volume(
                spec.volume_id,
                capacity_range=CapacityRange(required_bytes=size),
                access_type=kind,
                fs_type=fs,
                backend=backend,
                parameters=params,
                ephemeral=True,
            )
        except InvalidArgument as e:  # for an inline volume the parameters are the volume_context
            raise InvalidArgument(str(e).replace("parameters.", "volume_context.", 1)) from e
        staging = self.ephemeral_dir / validate_id("volume_id", spec.volume_id)
        try:
            self.stage(StageSpec(volume_id=v.volume_id, staging=staging, kind=kind, fs_type="", flags=spec.flags))
            self.publish(
                replace(spec, volume_id=v.volume_id, staging=staging, kind=kind, fs_type="", single_target=False)
            )
        except Exception:
            if is_new:  # undo only what this call made; a failed repeat leaves the working volume alone
                with contextlib.suppress(Exception):
                    self.unpublish_ephemeral(v, spec.target)
            raise

    def unpublish_ephemeral(self, v: Volume, target: Path) -> None:
        self.unpublish(v.volume_id, target)
        if self.store.list_publishes(v.volume_id):
            return  # kubelet published it elsewhere as well; delete with the last target
        staging = self.ephemeral_dir / v.name
        self.unstage(v.volume_id, staging)
        with contextlib.suppress(OSError):
            staging.rmdir()
        self.manager.delete_volume(v.volume_id)
        self.log.info("ephemeral volume deleted", volume_id=v.volume_id, name=v.name)
