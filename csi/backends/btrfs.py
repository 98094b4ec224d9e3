"""The btrfs backend: a subvolume per filesystem volume, sized by a qgroup limit; snapshots are subvolume snapshots.

Layout under ``<btrfs mount>/<subdir>`` (``base``)::

    volumes/<volume_id>          subvolume of a mount volume with fs type btrfs; qgroup 0/<id> limits its
                                 referenced bytes to the capacity, so writes beyond it fail with EDQUOT
    volumes/<volume_id>.img      loop file of a block volume, or of an ext4/xfs volume on this backend
    snapshots/<snapshot_id>      read-only snapshot of a subvolume (``btrfs subvolume snapshot -r``)
    snapshots/<snapshot_id>.img  reflink copy of a loop file

Restores and clones of subvolumes are writable snapshots (instant, copy-on-write) given their own limit; expansion
raises the limit and needs nothing on the node. Loop files are handled by :class:`LoopfileBackend` on the same base,
where FICLONE makes their copies instant too. Quotas are enabled on the filesystem once (``btrfs quota enable`` is
idempotent). New subvolumes are built under a temporary name and renamed into place, like files.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

from csi.backends import fileops
from csi.backends.loopfile import LoopfileBackend
from csi.errors import FailedPrecondition, Internal
from csi.model import Snapshot, Volume
from nodeplug.commands import CommandError, run
from nodeplug.log import get_logger

_log = get_logger("csi")
BTRFS_TIMEOUT = 120.0
_SUBVOL_ID = re.compile(r"^\s*Subvolume ID:\s*(\d+)\s*$", re.M)


# BTRFS_IOC_INO_LOOKUP = _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args {u64 treeid; u64 objectid; char[4080]})
_IOC_INO_LOOKUP = 0xD0009412
_FIRST_FREE_OBJECTID = 256  # the inode number of every subvolume's root directory


def subvolume_id(path: Path) -> int:
    """The id (qgroup 0/<id>) of the subvolume whose root is ``path``; 0 when it is not one (or is gone).

    Asked of the kernel with the INO_LOOKUP ioctl rather than parsed from ``btrfs subvolume list``, whose paths are
    relative to the filesystem's top level and so depend on how the filesystem is mounted.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        if os.fstat(fd).st_ino != _FIRST_FREE_OBJECTID:
            return 0
        buf = bytearray(struct.pack("=QQ", 0, _FIRST_FREE_OBJECTID) + bytes(4080))
        fcntl.ioctl(fd, _IOC_INO_LOOKUP, buf)
        return int(struct.unpack_from("=Q", buf)[0])
    except OSError:
        return 0
    finally:
        os.close(fd)


def qgroup_referenced(out: str) -> dict[int, int]:
    """qgroup 0/<id> -> referenced bytes, from the output of ``btrfs qgroup show --raw``."""
    used: dict[int, int] = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 2 and f[0].startswith("0/") and f[1].isdigit():
            used[int(f[0][2:])] = int(f[1])
    return used


def btrfs(*args: str, doing: str = "") -> str:
    return fileops.cmd(["btrfs", *args], BTRFS_TIMEOUT, doing)


class BtrfsBackend:
    """Subvolume volumes (and loop files) on the btrfs filesystem mounted at ``mount_point``."""

    name = "btrfs"

    def __init__(self, mount_point: Path, subdir: str = "nodeplug-csi", reserved_bytes: int = 0) -> None:
        self.mount_point = mount_point
        self.base = mount_point / subdir
        self.reserved_bytes = reserved_bytes
        self.files = LoopfileBackend(self.base, name="btrfs", fs_types=("ext4", "xfs"))
        self.volumes_dir = self.base / "volumes"
        self.snapshots_dir = self.base / "snapshots"
        self._ready = False

    # ------------------------------------------------------------ set-up and accounting

    def ready(self) -> None:
        if self._ready:
            return
        if not self.mount_point.is_dir():
            raise FailedPrecondition(f"btrfs backend: btrfs.path {self.mount_point} is not a directory")
        fs = fileops.fs_type_of(self.mount_point)
        if fs != "btrfs":
            raise FailedPrecondition(f"btrfs backend: btrfs.path {self.mount_point} is on {fs or 'unknown'}, not btrfs")
        btrfs("quota", "enable", str(self.mount_point), doing="enabling btrfs quotas")
        self.files.ready()
        self._ready = True

    def owns(self, path: str) -> bool:
        return fileops.is_under(Path(path), self.base)

    def supports(self, access_type: str, fs_type: str) -> str:
        if access_type == "mount" and fs_type == "btrfs":
            return ""
        return self.files.supports(access_type, fs_type)

    def _referenced(self) -> dict[int, int]:
        """qgroup 0/<id> -> referenced bytes."""
        return qgroup_referenced(btrfs("qgroup", "show", "--raw", str(self.mount_point), doing="reading qgroup usage"))

    def free_bytes(self, volumes: Iterable[Volume]) -> int:
        self.ready()
        vols = [v for v in volumes if v.backend == self.name]
        promised = 0
        subvols = [v for v in vols if v.is_subvolume]
        if subvols:
            used = self._referenced()
            for v in subvols:
                sid = subvolume_id(Path(v.path))
                promised += max(0, v.capacity_bytes - (used.get(sid, 0) if sid else 0))
        for v in vols:
            if not v.is_subvolume:
                promised += max(0, v.capacity_bytes - fileops.allocated_bytes(v.path))
        return max(0, fileops.free_bytes(self.base) - promised - self.reserved_bytes)

    # ------------------------------------------------------------ subvolume helpers

    def _subvolume_id(self, path: Path) -> int:
        sid = subvolume_id(path)
        if sid:
            return sid
        out = btrfs("subvolume", "show", str(path), doing=f"reading subvolume {path.name}")
        m = _SUBVOL_ID.search(out)
        if not m:
            raise Internal(f"btrfs subvolume show {path}: no 'Subvolume ID' in its output")
        return int(m.group(1))

    def _limit(self, path: Path, size: int) -> None:
        btrfs("qgroup", "limit", str(size), str(path), doing=f"setting the size limit of {path.name}")

    def _delete_subvolume(self, path: Path) -> bool:
        if not fileops.is_under(path, self.base):
            raise Internal(f"refusing to delete {path}: it is outside the driver's data dir {self.base}")
        if not path.exists():
            return False
        try:
            qgroup = self._subvolume_id(path)
        except Internal:
            qgroup = 0
        btrfs("subvolume", "delete", "--commit-after", str(path), doing=f"deleting subvolume {path.name}")
        if qgroup:
            try:  # the kernel keeps an empty qgroup behind; tidy it, but it is harmless if this fails
                run(["btrfs", "qgroup", "destroy", f"0/{qgroup}", str(self.mount_point)], timeout=BTRFS_TIMEOUT)
            except CommandError as e:
                _log.debug("qgroup not destroyed", qgroup=f"0/{qgroup}", error=str(e))
        return True

    def _fresh(self, final: Path) -> Path:
        self.ready()
        tmp = fileops.tmp_name(final)
        for p in (tmp, final):
            if self._delete_subvolume(p):
                _log.warning("removed an unrecorded leftover of an interrupted operation", path=str(p))
        return tmp

    def _limit_and_commit(self, tmp: Path, final: Path, size: int) -> str:
        """Give the new subvolume ``tmp`` its size limit and rename it to ``final``; delete it if the limit fails."""
        try:
            self._limit(tmp, size)
        except BaseException:
            self._delete_subvolume(tmp)
            raise
        return fileops.commit(tmp, final)

    def _subvolume_from(self, src: Path, volume_id: str, size: int) -> str:
        final = self.volumes_dir / volume_id
        tmp = self._fresh(final)
        btrfs("subvolume", "snapshot", str(src), str(tmp), doing=f"copying {src.name} into {volume_id}")
        return self._limit_and_commit(tmp, final, size)

    # ------------------------------------------------------------ volumes

    def create(self, volume_id: str, size: int, access_type: str, fs_type: str) -> str:
        if not (access_type == "mount" and fs_type == "btrfs"):
            self.ready()
            return self.files.create(volume_id, size, access_type, fs_type)
        final = self.volumes_dir / volume_id
        tmp = self._fresh(final)
        btrfs("subvolume", "create", str(tmp), doing=f"creating subvolume {volume_id}")
        return self._limit_and_commit(tmp, final, size)

    def create_from_snapshot(self, volume_id: str, size: int, snapshot: Snapshot) -> str:
        if not snapshot.is_subvolume:
            self.ready()
            return self.files.create_from_snapshot(volume_id, size, snapshot)
        return self._subvolume_from(Path(snapshot.path), volume_id, size)

    def clone(self, volume_id: str, size: int, source: Volume) -> str:
        if not source.is_subvolume:
            self.ready()
            return self.files.clone(volume_id, size, source)
        return self._subvolume_from(Path(source.path), volume_id, size)

    def delete(self, volume: Volume) -> None:
        if not volume.is_subvolume:
            self.files.delete(volume)
            return
        self._delete_subvolume(Path(volume.path))
        self._delete_subvolume(fileops.tmp_name(Path(volume.path)))

    def expand(self, volume: Volume, new_size: int) -> bool:
        if not volume.is_subvolume:
            return self.files.expand(volume, new_size)
        self._limit(Path(volume.path), new_size)
        return False

    # ------------------------------------------------------------ snapshots

    def snapshot(self, snapshot_id: str, volume: Volume) -> tuple[str, int]:
        if not volume.is_subvolume:
            self.ready()
            return self.files.snapshot(snapshot_id, volume)
        final = self.snapshots_dir / snapshot_id
        tmp = self._fresh(final)
        btrfs("subvolume", "snapshot", "-r", volume.path, str(tmp), doing=f"snapshotting {volume.volume_id}")
        return fileops.commit(tmp, final), volume.capacity_bytes

    def delete_snapshot(self, snapshot: Snapshot) -> None:
        if not snapshot.is_subvolume:
            self.files.delete_snapshot(snapshot)
            return
        self._delete_subvolume(Path(snapshot.path))

    # ------------------------------------------------------------ health

    def condition(self, volume: Volume) -> str:
        if not volume.is_subvolume:
            return self.files.condition(volume)
        p = Path(volume.path)
        if not p.is_dir():
            return f"subvolume {p} is missing"
        try:
            self._subvolume_id(p)
        except Internal as e:
            return f"subvolume {p} is not a btrfs subvolume: {e}"
        return ""
