"""Host work behind the Node service: loop devices, formatting, mounts, records. Synchronous, one volume at a time.

:class:`csi.node.NodeServicer` validates requests and holds the volume's lock; :class:`NodeHost` does the work in a
worker thread. Every step first looks at the host (mount table, attached loop devices) and only then acts, so a
repeated or interrupted call converges instead of failing: a stage after a reboot re-attaches the loop device and
re-mounts; an unpublish of a target that is already gone just tidies the record.

Records kept (in the volume manager's SQLite store): a stage record per staged volume (staging path, device) and a
publish record per target. They are written after the host change succeeds; the host state found on a repeat call is
adopted, so a kill -9 between the change and the record loses nothing. Nothing is removed outside kubelet's
directory (targets, resolved and checked by the servicer) and the driver's own plugin directory (ephemeral staging).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from csi import loopdev, mounts
from csi.backends import btrfs, fileops
from csi.errors import AlreadyExists, FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange
from csi.model import PublishRecord, StageRecord, Volume, validate_id
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.commands import CommandError, run
from nodeplug.log import Logger, get_logger

EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
DEFAULT_EPHEMERAL_BYTES = 100 << 20
# Per-mount flags a bind remount can change; filesystem options (discard, nouuid, ...) apply at stage only.
PER_MOUNT_FLAGS = frozenset({"nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime", "strictatime"})
FS_TIMEOUT = 300.0
_SIZE_RE = re.compile(r"(\d+)\s*(|k|Ki|M|Mi|G|Gi|T|Ti)")
_UNITS = {
    "": 1,
    "k": 10**3,
    "Ki": 1 << 10,
    "M": 10**6,
    "Mi": 1 << 20,
    "G": 10**9,
    "Gi": 1 << 30,
    "T": 10**12,
    "Ti": 1 << 40,
}


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


@dataclass(frozen=True)
class VolumeStats:
    total_bytes: int | None
    fs: mounts.FsStats | None
    problem: str | None


def parse_size(text: str) -> int:
    m = _SIZE_RE.fullmatch(text.strip())
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

    # ------------------------------------------------------------ stage

    def stage(self, spec: StageSpec) -> None:
        v = self.volume(spec.volume_id)
        self._check_kind(v, spec.kind, spec.fs_type)
        rec = self.store.get_stage(v.volume_id)
        if rec is not None and rec.staging_path != str(spec.staging):
            raise FailedPrecondition(
                f"volume {v.volume_id} is already staged at {rec.staging_path}; unstage it before staging elsewhere"
            )
        backing = self.backing(v)
        if not backing.exists():
            raise FailedPrecondition(f"volume {v.volume_id}: its backing {backing} is missing; the data is gone")
        spec.staging.mkdir(parents=True, exist_ok=True)
        if v.is_block:
            device = loopdev.attach_rw(backing)
        elif v.is_subvolume:
            device = ""
            self._mount_once(spec, lambda: mounts.bind_mount(backing, spec.staging, False, spec.flags), v)
        else:
            device = loopdev.attach_rw(backing)
            fs = v.fs_type or spec.fs_type or "ext4"

            def do_mount() -> None:
                have = mounts.fs_size(device, fs)  # the superblock, without spawning blkid in the common case
                if have is None:
                    found = fs_type_of(device)
                    if not found:
                        fileops.cmd(
                            ["mkfs." + fs, *(["-q"] if fs == "ext4" else []), device],
                            FS_TIMEOUT,
                            f"formatting {v.volume_id}",
                        )
                    elif found != fs:
                        raise FailedPrecondition(f"volume {v.volume_id} holds {found}, not {fs}")
                    have = mounts.fs_size(device, fs)
                # a volume expanded while unstaged: its device is larger than its filesystem
                grown = have is not None and mounts.block_size(device) - have >= 1 << 20
                if grown and fs == "ext4":  # offline growth needs no CAP_SYS_RESOURCE, unlike the online ioctl
                    fileops.grow_fs_offline(Path(device), fs, self.ephemeral_dir.parent)
                mounts.mount(device, spec.staging, fs, spec.flags)
                if grown and fs == "xfs":  # xfs grows only while mounted
                    fileops.cmd(["xfs_growfs", str(spec.staging)], FS_TIMEOUT, f"growing xfs of {v.volume_id}")

            self._mount_once(spec, do_mount, v)
        if rec != StageRecord(v.volume_id, str(spec.staging), device):
            self.store.put_stage(StageRecord(v.volume_id, str(spec.staging), device))
        self.log.info("staged", volume_id=v.volume_id, staging=str(spec.staging), device=device or None)

    def _mount_once(self, spec: StageSpec, do_mount: Callable[[], None], v: Volume) -> None:
        entry = mounts.find_mount(spec.staging)
        if entry is None:
            try:
                do_mount()
            except CommandError as e:
                raise Internal.from_command(e, f"mounting volume {v.volume_id}") from e
            return
        want_type = "btrfs" if v.is_subvolume else (v.fs_type or spec.fs_type or "ext4")
        if entry.fs_type != want_type:
            raise AlreadyExists(
                f"staging_target_path {spec.staging} already holds a {entry.fs_type} mount, not this {want_type} volume"
            )
        missing = [f for f in spec.flags if f in PER_MOUNT_FLAGS | {"ro"} and f not in entry.options]
        if missing:
            raise AlreadyExists(f"volume {v.volume_id} is staged at {spec.staging} without mount flags {missing}")

    def _check_kind(self, v: Volume, kind: str, fs_type: str) -> None:
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
        busy = [p.target_path for p in self.store.list_publishes(volume_id) if mounts.is_mounted(p.target_path)]
        if busy:
            raise FailedPrecondition(f"volume {volume_id} is still published at {busy[0]}; unpublish it first")
        for p in self.store.list_publishes(volume_id):  # stale: their targets are no longer mounted
            self.store.delete_publish(volume_id, p.target_path)
        try:
            mounts.unmount(staging)
        except CommandError as e:
            raise Internal.from_command(e, f"unmounting the staging path of {volume_id}") from e
        # every loop device over the volume's file: the staged one and read-only ones a crash left behind
        devices = [d for d, _ in loopdev.devices_of(self.backing(v))] if v is not None and not v.is_subvolume else []
        for d in devices:
            loopdev.detach(d)
        device = ",".join(devices)
        if rec is not None:
            self.store.delete_stage(volume_id)
        self.log.info("unstaged", volume_id=volume_id, staging=str(staging), device=device or None)

    # ------------------------------------------------------------ publish

    def publish(self, spec: PublishSpec) -> None:
        v = self.volume(spec.volume_id)
        self._check_kind(v, spec.kind, spec.fs_type)
        rec = self.store.get_stage(v.volume_id)
        if rec is None or (spec.staging is not None and rec.staging_path != str(spec.staging)):
            raise FailedPrecondition(f"volume {v.volume_id} is not staged at {spec.staging}; call NodeStageVolume")
        target = str(spec.target)
        existing = self.store.get_publish(v.volume_id, target)
        entry = mounts.find_mount(spec.target)
        if entry is not None:
            self._check_publish_compatible(v, spec, existing, entry)
            if existing is None:
                self.store.put_publish(PublishRecord(v.volume_id, target, spec.readonly, rec.staging_path))
            return
        if spec.single_target:
            others = [p.target_path for p in self.store.list_publishes(v.volume_id) if p.target_path != target]
            if [o for o in others if mounts.is_mounted(o)]:
                raise FailedPrecondition(
                    f"volume {v.volume_id} is already published at {others[0]} and its access mode allows one target"
                )
        flags = [f for f in spec.flags if f in PER_MOUNT_FLAGS]
        try:
            if v.is_block:
                self._publish_block(v, spec, rec, flags)
            else:
                if not mounts.is_mounted(rec.staging_path):
                    raise FailedPrecondition(
                        f"volume {v.volume_id}: nothing is mounted at {rec.staging_path}; stage it again"
                    )
                spec.target.mkdir(mode=0o750, exist_ok=True)
                mounts.bind_mount(rec.staging_path, spec.target, spec.readonly, flags)
        except CommandError as e:
            raise Internal.from_command(e, f"publishing volume {v.volume_id}") from e
        self.store.put_publish(PublishRecord(v.volume_id, target, spec.readonly, rec.staging_path))
        self.log.info("published", volume_id=v.volume_id, target=target, readonly=spec.readonly)

    def _publish_block(self, v: Volume, spec: PublishSpec, rec: StageRecord, flags: list[str]) -> None:
        device = loopdev.rw_device(self.backing(v))
        if device is None:
            raise FailedPrecondition(f"volume {v.volume_id}: its loop device is gone; stage it again")
        if spec.readonly:  # a read-only bind of a device node does not stop writes to the device
            device = fileops.cmd(
                ["losetup", "-r", "-f", "--show", str(self.backing(v))], FS_TIMEOUT, "attaching read-only"
            ).strip()
        if not spec.target.exists():
            spec.target.touch(mode=0o640)
        try:
            mounts.bind_mount(device, spec.target, spec.readonly, flags)
        except CommandError:
            if spec.readonly:
                loopdev.detach(device)
            raise

    def _check_publish_compatible(
        self, v: Volume, spec: PublishSpec, existing: PublishRecord | None, entry: mounts.MountEntry
    ) -> None:
        where = f"volume {v.volume_id} is already published at {spec.target}"
        if v.is_block and entry.fs_type == "devtmpfs":
            ours = {"/" + Path(dev).name for dev, _ in loopdev.devices_of(self.backing(v))}
            if entry.root not in ours:
                raise AlreadyExists(f"target_path {spec.target} already holds another device (/dev{entry.root})")
        elif existing is None and entry.fs_type != "devtmpfs":
            stage_entry = self.store.get_stage(v.volume_id)
            staged = mounts.find_mount(stage_entry.staging_path) if stage_entry else None
            if staged is None or staged.dev != entry.dev:
                raise AlreadyExists(f"target_path {spec.target} already holds another mount ({entry.source})")
        if entry.readonly != spec.readonly:
            raise AlreadyExists(f"{where} {'read-only' if entry.readonly else 'read-write'}; unpublish it first")
        missing = [f for f in spec.flags if f in PER_MOUNT_FLAGS and f not in entry.options]
        if missing:
            raise AlreadyExists(f"{where} without mount flags {missing}")
        rec = self.store.get_stage(v.volume_id)
        staged = mounts.find_mount(rec.staging_path) if rec and not v.is_block else None
        inherited = set(staged.options) if staged else set()
        extra = sorted((set(entry.options) & PER_MOUNT_FLAGS) - set(spec.flags) - inherited - {"relatime"})
        if extra:
            raise AlreadyExists(f"{where} with other mount flags {extra}")
        if (entry.fs_type == "devtmpfs") != v.is_block:
            raise AlreadyExists(f"{where} with another access type")

    def unpublish(self, volume_id: str, target: Path) -> None:
        rec = self.store.get_publish(volume_id, str(target))
        if rec is None:
            try:
                self.volume(volume_id)
            except NotFound:
                if not mounts.is_mounted(target):
                    raise
        entry = mounts.find_mount(target)
        ro_device = ""
        if entry is not None and entry.fs_type == "devtmpfs":
            dev = "/dev" + entry.root
            with contextlib.suppress(OSError):
                if Path(f"/sys/block/{Path(dev).name}/ro").read_text().strip() == "1":
                    ro_device = dev
        try:
            mounts.unmount(target)
        except CommandError as e:
            raise Internal.from_command(e, f"unmounting {target}") from e
        if ro_device and ro_device.startswith("/dev/loop"):
            loopdev.detach(ro_device)
        with contextlib.suppress(FileNotFoundError):
            if target.is_dir() and not target.is_symlink():
                target.rmdir()
            else:
                target.unlink()
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
                spec.volume_id, CapacityRange(required_bytes=size), kind, fs, backend, params, ephemeral=True
            )
        except InvalidArgument as e:  # for an inline volume the parameters are the volume_context
            raise InvalidArgument(str(e).replace("parameters.", "volume_context.", 1)) from e
        staging = self.ephemeral_dir / validate_id("volume_id", spec.volume_id)
        try:
            self.stage(StageSpec(v.volume_id, staging, kind, "", spec.flags))
            self.publish(PublishSpec(v.volume_id, spec.target, staging, kind, "", spec.flags, spec.readonly, False))
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

    # ------------------------------------------------------------ stats and expansion

    def _where(self, v: Volume, path: Path) -> tuple[StageRecord, bool]:
        """The volume's stage record and whether ``path`` is one of its publish targets (else the staging path)."""
        rec = self.store.get_stage(v.volume_id)
        published = self.store.get_publish(v.volume_id, str(path)) is not None
        if rec is None or (rec.staging_path != str(path) and not published):
            raise NotFound(f"volume {v.volume_id} is not staged or published at {path}")
        return rec, published

    def stats(self, volume_id: str, path: Path) -> VolumeStats:
        v = self.volume(volume_id)
        _, published = self._where(v, path)
        backing = self.backing(v)
        if not backing.exists():
            return VolumeStats(
                None, None, f"the backing {'subvolume' if v.is_subvolume else 'file'} {backing} is missing"
            )
        entry = mounts.find_mount(path)
        if v.is_block:
            device = loopdev.rw_device(backing)
            if device is None:
                return VolumeStats(None, None, f"the loop device of {backing} is gone; stage the volume again")
            if published and entry is None:
                return VolumeStats(None, None, f"nothing is mounted at {path}: the published device is gone")
            return VolumeStats(mounts.block_size(device), None, None)
        if entry is None:
            return VolumeStats(None, None, f"nothing is mounted at {path}: the volume's mount is gone")
        problem = mounts.fs_problem(entry, expect_rw=not entry.readonly)
        if problem:
            return VolumeStats(None, None, problem)
        fs = mounts.fs_stats(path)
        if v.is_subvolume:
            fs = self._subvolume_usage(v, backing, fs)
        return VolumeStats(fs.total_bytes, fs, None)

    def _subvolume_usage(self, v: Volume, backing: Path, fs: mounts.FsStats) -> mounts.FsStats:
        """statvfs sees the whole btrfs filesystem; the volume is its qgroup (referenced bytes, limit)."""
        try:
            out = run(["btrfs", "qgroup", "show", "-r", "--raw", "-f", str(backing)], 30)
        except CommandError:
            return fs
        used = next(iter(btrfs.qgroup_referenced(out).values()), None)  # -f: only the subvolume's own qgroup
        if used is None:
            return fs
        total = v.capacity_bytes
        avail = max(0, min(fs.available_bytes, total - used))
        return mounts.FsStats(total, avail, used, fs.total_inodes, fs.free_inodes, fs.used_inodes)

    def expand(self, volume_id: str, path: Path, kind: str, required: int) -> int:
        v = self.volume(volume_id)
        rec, _ = self._where(v, path)
        if v.is_subvolume:
            return max(v.capacity_bytes, required)  # the qgroup limit was raised with the volume's record
        device = loopdev.rw_device(self.backing(v))
        if device is None:
            raise FailedPrecondition(f"volume {v.volume_id} has no loop device; stage it again")
        loopdev.refresh_size(device)
        size = mounts.block_size(device)
        if required and size < required:
            raise OutOfRange(
                f"volume {v.volume_id} is {size} bytes, less than {required}; its backing file did not grow"
            )
        if v.is_block or kind == "block":
            return size
        if not mounts.is_mounted(rec.staging_path):
            raise FailedPrecondition(f"volume {v.volume_id} is not mounted at {rec.staging_path}; stage it again")
        if v.fs_type == "xfs":
            fileops.cmd(["xfs_growfs", rec.staging_path], FS_TIMEOUT, f"growing xfs of {v.volume_id}")
        else:
            try:
                run(["resize2fs", device], FS_TIMEOUT)
            except CommandError as e:
                hint = (
                    "; online ext4 growth needs CAP_SYS_RESOURCE in the agent"
                    if "Permission denied" in e.stderr
                    else ""
                )
                raise Internal(f"growing ext4 of {v.volume_id}: {e}{hint}") from e
        self.log.info("expanded", volume_id=v.volume_id, bytes=size)
        return size
