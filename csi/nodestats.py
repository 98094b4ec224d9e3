"""NodeGetVolumeStats and NodeExpandVolume: a staged or published volume's usage, health and growth on this node.

Both only look up the path they are given among the volume's records (its staging path or one of its publish
targets): a path the volume is not at is NOT_FOUND, and nothing at an unrecorded path is ever read or changed.
Health comes from the host (the backing file or subvolume present, a loop device attached, a mount in place, the
kernel's filesystem error reports: :func:`csi.mounts.fs_problem`). Synchronous; the servicer calls these through
``asyncio.to_thread`` holding the volume's lock (expansion).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from csi import holders, loopdev, mounts
from csi.backends import btrfs, fileops
from csi.errors import FailedPrecondition, Internal, NotFound, OutOfRange
from csi.model import StageRecord, Volume
from nodeplug.commands import CommandError, run

if TYPE_CHECKING:
    from csi.nodehost import NodeHost

FS_TIMEOUT = 300.0


@dataclass(frozen=True)
class VolumeStats:
    total_bytes: int | None
    fs: mounts.FsStats | None
    problem: str | None


def where(host: NodeHost, v: Volume, path: Path) -> tuple[StageRecord, bool]:
    """The volume's stage record and whether ``path`` is one of its publish targets (else the staging path)."""
    rec = host.store.get_stage(v.volume_id)
    published = host.store.get_publish(v.volume_id, str(path)) is not None
    if rec is None or (rec.staging_path != str(path) and not published):
        raise NotFound(f"volume {v.volume_id} is not staged or published at {path}")
    return rec, published


def stats(host: NodeHost, volume_id: str, path: Path) -> VolumeStats:
    v = host.volume(volume_id)
    _, published = where(host, v, path)
    backing = host.backing(v)
    if not backing.exists():
        return VolumeStats(None, None, f"the backing {'subvolume' if v.is_subvolume else 'file'} {backing} is missing")
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
        fs = subvolume_usage(v, backing, fs)
    return VolumeStats(fs.total_bytes, fs, None)


def subvolume_usage(v: Volume, backing: Path, fs: mounts.FsStats) -> mounts.FsStats:
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
    return replace(fs, total_bytes=total, available_bytes=avail, used_bytes=used)


def in_use(host: NodeHost, v: Volume) -> bool:
    """A pod has the volume: any publish record (a kubelet that expands a volume it is mounting right after staging
    it calls before any publish)."""
    return bool(host.store.list_publishes(v.volume_id))


def expand(host: NodeHost, volume_id: str, path: Path, *, kind: str, required: int) -> int:
    """Grow the volume's filesystem to fill its (grown) backing: xfs online (xfs_growfs needs no capability); ext4
    not at all when it fills the device already (grown at stage, :mod:`csi.pvsize`), offline when no pod has it
    published (:meth:`NodeHost.grow_unused`), online otherwise, which needs CAP_SYS_RESOURCE."""
    v = host.volume(volume_id)
    rec, _ = where(host, v, path)
    host.check_kind(v, kind, "")  # a block capability for a filesystem volume would skip growing the filesystem
    if v.is_subvolume:
        return max(v.capacity_bytes, required)  # the qgroup limit was raised with the volume's record
    device = loopdev.rw_device(host.backing(v))
    if device is None:
        raise FailedPrecondition(f"volume {v.volume_id} has no loop device; stage it again")
    loopdev.refresh_size(device)
    size = mounts.block_size(device)
    if required and size < required:
        raise OutOfRange(f"volume {v.volume_id} is {size} bytes, less than {required}; its backing file did not grow")
    if v.is_block:
        return size
    if not holders.holds(v, host.backing(v), rec.staging_path):
        raise FailedPrecondition(f"volume {v.volume_id} is not mounted at {rec.staging_path}; stage it again")
    have = None if v.fs_type == "xfs" else mounts.fs_size(device, "ext4")
    if have is not None and size - have < 1 << 20:  # grown at stage already (csi.pvsize): nothing to grow
        host.log.info("filesystem fills the volume already", volume_id=v.volume_id, bytes=size)
    elif v.fs_type == "xfs":
        fileops.cmd(["xfs_growfs", rec.staging_path], FS_TIMEOUT, f"growing xfs of {v.volume_id}")
    elif not in_use(host, v) and host.grow_unused(v, Path(rec.staging_path), device):
        host.log.info("grown offline: no pod has it published", volume_id=v.volume_id)
    else:
        try:
            run(["resize2fs", device], FS_TIMEOUT)
        except CommandError as e:
            hint = "; online ext4 growth needs CAP_SYS_RESOURCE in the agent" if "Permission denied" in e.stderr else ""
            raise Internal(f"growing ext4 of {v.volume_id}: {e}{hint}") from e
    host.log.info("expanded", volume_id=v.volume_id, bytes=size)
    return size
