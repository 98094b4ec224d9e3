"""The loop-file backend: one sparse file per volume under a base directory.

Layout under ``base``::

    volumes/<volume_id>.img      the volume: ext4/xfs image (mount) or raw bytes (block); size == capacity
    snapshots/<snapshot_id>.img  a copy of a volume's file at snapshot time
    volumes/.tmp-<name>          a file being built; renamed into place when complete

The file size is the capacity, so a pod cannot write more than it asked for. mkfs runs on the file itself; the node
side attaches a loop device at stage time. Copies use FICLONE where the base's filesystem shares extents (btrfs, XFS
with reflink) and a sparse copy elsewhere. Growing a restored or cloned volume beyond its source grows the file and
then the filesystem offline, and an xfs copy gets its own UUID so it can be mounted beside its source (see
:func:`csi.backends.fileops.finish_copy`); ``expand`` of a live volume only grows the file and leaves the loop device
and filesystem to the node (NodeExpandVolume).

The same class serves the btrfs backend's file volumes (block, ext4/xfs) with ``name="btrfs"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from csi.backends import fileops
from csi.errors import FailedPrecondition
from csi.model import Snapshot, Volume
from nodeplug.log import get_logger

_log = get_logger("csi")


class LoopfileBackend:
    """File volumes in ``base``; ``reserved_bytes`` of free space are never handed out."""

    def __init__(self, base: Path, name: str = "loopfile", reserved_bytes: int = 0, fs_types: tuple[str, ...] = ()):
        self.name = name
        self.base = base
        self.reserved_bytes = reserved_bytes
        self.fs_types = fs_types or ("ext4", "xfs")
        self.volumes_dir = base / "volumes"
        self.snapshots_dir = base / "snapshots"
        self._ready = False

    # ------------------------------------------------------------ set-up and accounting

    def ready(self) -> None:
        if self._ready:
            return
        try:
            for d in (self.base, self.volumes_dir, self.snapshots_dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise FailedPrecondition(f"{self.name} backend: cannot create {e.filename}: {e.strerror}") from e
        self._ready = True

    def owns(self, path: str) -> bool:
        return fileops.is_under(Path(path), self.base)

    def supports(self, access_type: str, fs_type: str) -> str:
        if access_type == "block" or fs_type in self.fs_types:
            return ""
        return f"fs_type {fs_type!r} is not supported by the {self.name} backend (expected one of {self.fs_types})"

    def free_bytes(self, volumes: Iterable[Volume]) -> int:
        self.ready()
        promised = 0
        prefix = str(self.base) + "/"  # recorded paths are the ones built here: a prefix test is enough
        for v in volumes:
            if v.backend == self.name and not v.is_subvolume and v.path.startswith(prefix):
                promised += max(0, v.capacity_bytes - fileops.allocated_bytes(v.path))
        return max(0, fileops.free_bytes(self.base) - promised - self.reserved_bytes)

    def volume_file(self, volume_id: str) -> Path:
        return self.volumes_dir / f"{volume_id}.img"

    def snapshot_file(self, snapshot_id: str) -> Path:
        return self.snapshots_dir / f"{snapshot_id}.img"

    # ------------------------------------------------------------ volumes

    def _fresh(self, final: Path) -> Path:
        """Clear what a crash may have left at ``final`` (never recorded, never handed out) and its temp name."""
        self.ready()
        tmp = fileops.tmp_name(final)
        for p in (tmp, final):
            if fileops.remove_under(p, self.base):
                _log.warning("removed an unrecorded leftover of an interrupted operation", path=str(p))
        return tmp

    def create(self, volume_id: str, size: int, access_type: str, fs_type: str) -> str:
        final = self.volume_file(volume_id)
        tmp = self._fresh(final)
        try:
            fileops.make_sparse(tmp, size)
            if access_type == "mount":
                fileops.mkfs(tmp, fs_type)
        except BaseException:
            fileops.remove_under(tmp, self.base)
            raise
        return fileops.commit(tmp, final)

    @staticmethod
    def _require(path: Path, what: str) -> Path:
        if not path.is_file():
            raise FailedPrecondition(f"{what} {path} is missing: the volume's data is gone (see ControllerGetVolume)")
        return path

    def _copy_in(self, src: Path, volume_id: str, size: int, *, access_type: str, fs_type: str) -> str:
        self._require(src, "source file")
        final = self.volume_file(volume_id)
        tmp = self._fresh(final)
        try:
            fileops.copy_file(src, tmp)
            grow = size > os.stat(tmp).st_size
            if grow:
                fileops.grow_file(tmp, size)
            if access_type == "mount":
                fileops.finish_copy(tmp, fs_type, grow, self.base)
        except BaseException:
            fileops.remove_under(tmp, self.base)
            raise
        return fileops.commit(tmp, final)

    def create_from_snapshot(self, volume_id: str, size: int, snapshot: Snapshot) -> str:
        return self._copy_in(
            Path(snapshot.path), volume_id, size, access_type=snapshot.access_type, fs_type=snapshot.fs_type
        )

    def clone(self, volume_id: str, size: int, source: Volume) -> str:
        return self._copy_in(Path(source.path), volume_id, size, access_type=source.access_type, fs_type=source.fs_type)

    def delete(self, volume: Volume) -> None:
        fileops.remove_under(Path(volume.path), self.base)
        fileops.remove_under(fileops.tmp_name(Path(volume.path)), self.base)

    def expand(self, volume: Volume, new_size: int) -> bool:
        fileops.grow_file(self._require(Path(volume.path), "backing file"), new_size)
        return True

    # ------------------------------------------------------------ snapshots

    def snapshot(self, snapshot_id: str, volume: Volume) -> tuple[str, int]:
        final = self.snapshot_file(snapshot_id)
        tmp = self._fresh(final)
        try:
            how = fileops.copy_file(self._require(Path(volume.path), "backing file"), tmp)
            os.chmod(tmp, 0o400)
        except BaseException:
            fileops.remove_under(tmp, self.base)
            raise
        _log.debug("snapshot copied", snapshot_id=snapshot_id, volume_id=volume.volume_id, how=how)
        path = fileops.commit(tmp, final)
        return path, os.stat(path).st_size

    def delete_snapshot(self, snapshot: Snapshot) -> None:
        fileops.remove_under(Path(snapshot.path), self.base)

    # ------------------------------------------------------------ health

    def condition(self, volume: Volume) -> str:
        p = Path(volume.path)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return f"backing file {p} is missing"
        except OSError as e:
            return f"backing file {p} cannot be read: {e.strerror}"
        if st.st_size < volume.capacity_bytes:
            return f"backing file {p} is {st.st_size} bytes, smaller than the volume's {volume.capacity_bytes}"
        if volume.access_type == "mount":
            return fileops.fs_errors(p, volume.fs_type)
        return ""
