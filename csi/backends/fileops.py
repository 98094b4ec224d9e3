"""File-level operations shared by the backends: sparse files, reflink/sparse copies, mkfs, offline growth, freeze.

A file volume is a sparse file whose size is the volume's capacity. Copies (snapshots, restores, clones) first try
the FICLONE ioctl, which shares extents on btrfs and on XFS with reflink (instant, atomic with respect to writers),
and fall back to a sparse copy (``cp --sparse=always``), which reads only the allocated ranges.

New files are built under a temporary name in the destination directory and renamed into place when complete, so a
crash never leaves a half-written file under a final name; :func:`remove_under` deletes only paths inside a base
directory the caller owns, and refuses anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from csi import offlinegrow
from csi.errors import Internal
from nodeplug.commands import CommandError, run
from nodeplug.fsutil import fsync_dir

FICLONE = 0x40049409
MIB = 1 << 20
MKFS_TIMEOUT = 300.0
COPY_TIMEOUT = 1800.0
FSCK_TIMEOUT = 600.0
FREEZE_TIMEOUT = 30.0
XFS_MIN_BYTES = 300 * MIB  # mkfs.xfs refuses smaller filesystems (xfsprogs >= 5.19)
EXT4_MIN_BYTES = 1 * MIB


def cmd(argv: list[str], timeout: float, doing: str = "") -> str:
    """Run a command; a failure becomes Internal naming the command and its stderr."""
    try:
        return run(argv, timeout=timeout)
    except CommandError as e:
        raise Internal.from_command(e, doing) from e


def make_dirs(path: Path, mode: int = 0o750) -> list[Path]:
    """``mkdir -p path``; return the directories this call created, outermost first (one made meanwhile by someone
    else is theirs and not listed)."""
    made = []
    for p in [p for p in (path, *path.parents) if not p.exists()][::-1]:
        try:
            p.mkdir(mode=mode)
        except FileExistsError:
            continue
        made.append(p)
    return made


def remove_dirs(made: list[Path]) -> None:
    """Remove directories :func:`make_dirs` created, deepest first, only while empty (never a recursive delete)."""
    for p in reversed(made):
        with contextlib.suppress(OSError):
            p.rmdir()


def tmp_name(final: Path) -> Path:
    """The temporary sibling a new file or subvolume is built under before it is renamed to ``final``."""
    return final.with_name(f".tmp-{final.name}")


def commit(tmp: Path, final: Path) -> str:
    """Rename the finished ``tmp`` (see :func:`tmp_name`) to ``final`` durably; return ``final`` as a string."""
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return str(final)


def make_sparse(path: Path, size: int) -> None:
    """Create ``path`` (which must not exist) as a sparse file of ``size`` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_file(src: Path, dst: Path) -> str:
    """Copy ``src`` to the new file ``dst``; return ``"reflink"`` or ``"sparse"`` (how it was copied)."""
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(dfd, FICLONE, sfd)
            os.fsync(dfd)
            return "reflink"
        except OSError:
            pass
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    os.unlink(dst)
    cmd(["cp", "--sparse=always", "--reflink=never", "--", str(src), str(dst)], COPY_TIMEOUT, "copying volume data")
    fd = os.open(dst, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return "sparse"


def allocated_bytes(path: str | Path) -> int:
    """Bytes actually allocated on disk for ``path`` (0 when it is missing)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def free_bytes(path: Path) -> int:
    """Free bytes available to unprivileged writers on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fs_type_of(path: Path) -> str:
    """The filesystem type holding ``path`` (``findmnt -T``)."""
    return cmd(["findmnt", "-n", "-o", "FSTYPE", "-T", str(path)], 10.0, "finding the filesystem type").strip()


def min_fs_bytes(fs_type: str) -> int:
    return XFS_MIN_BYTES if fs_type == "xfs" else EXT4_MIN_BYTES


def mkfs(path: Path, fs_type: str) -> None:
    """Format the file ``path`` directly (no loop device needed)."""
    if fs_type == "ext4":
        # lazy init keeps a sparse file sparse; -m 0: no reserved blocks, the volume's capacity is the user's.
        argv = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"]
    elif fs_type == "xfs":
        argv = ["mkfs.xfs", "-q", "-f", "-K"]
    else:
        raise Internal(f"mkfs: unsupported filesystem type {fs_type!r}")
    cmd([*argv, str(path)], MKFS_TIMEOUT, f"formatting {path.name} as {fs_type}")


def grow_file(path: Path, size: int) -> None:
    """Grow the file to ``size`` bytes (never shrinks)."""
    if os.stat(path).st_size < size:
        os.truncate(path, size)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _xfs_mounted(path: Path, scratch: Path) -> Iterator[Path]:
    """``path`` mounted for the moment under ``scratch`` (``loop,nouuid``: a copy shares its source's UUID)."""
    mnt = Path(tempfile.mkdtemp(prefix=".xfs-", dir=scratch))
    try:
        cmd(["mount", "-t", "xfs", "-o", "loop,nouuid", str(path), str(mnt)], 60.0, f"mounting {path.name}")
        try:
            yield mnt
        finally:
            cmd(["umount", str(mnt)], 60.0, f"unmounting {path.name}")
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


def finish_copy(path: Path, fs_type: str, grow: bool, scratch: Path) -> None:
    """Make the unmounted filesystem image ``path``, a copy of another volume, ready to be used on its own.

    ext4: checked (``e2fsck -f -p``, which also replays the journal of a copy of a mounted filesystem) and grown
    when ``grow``; a duplicate ext4 UUID is harmless.
    xfs: two mounted xfs with one UUID cannot coexist, and ``xfs_admin -U`` needs a clean log, which a copy of a
    mounted (frozen) filesystem lacks; so the copy is mounted for the moment (replaying its log), grown when
    ``grow``, unmounted, and given a new UUID.
    """
    if fs_type == "ext4":
        if grow:
            offlinegrow.resize(path)
    elif fs_type == "xfs":
        with _xfs_mounted(path, scratch) as mnt:
            if grow:
                cmd(["xfs_growfs", str(mnt)], FSCK_TIMEOUT, f"growing the filesystem in {path.name}")
        out = cmd(["xfs_admin", "-U", "generate", str(path)], FSCK_TIMEOUT, f"giving {path.name} a new UUID")
        if "new UUID" not in out:  # xfs_admin exits 0 even when it refuses
            raise Internal(f"xfs_admin -U generate {path}: the UUID was not changed: {out.strip()[:300]}")
    else:
        raise Internal(f"unsupported filesystem type {fs_type!r}")


def fs_errors(path: Path, fs_type: str) -> str:
    """A message when the filesystem image in ``path`` records errors ("" when it looks healthy or cannot tell)."""
    if fs_type != "ext4":
        return ""
    try:
        out = run(["dumpe2fs", "-h", str(path)], timeout=30.0)
    except CommandError as e:
        return f"cannot read the ext4 superblock: {e}"
    for line in out.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "Filesystem state" and "error" in value:
            return f"ext4 reports errors (state: {value}): run e2fsck on the volume"
        if key == "FS Error count" and value.isdigit() and int(value) > 0:
            return f"ext4 has recorded {value} errors: run e2fsck on the volume"
    return ""


@contextlib.contextmanager
def frozen(mount_points: list[str]) -> Iterator[None]:
    """Freeze the filesystems mounted at ``mount_points`` (fsfreeze -f) for the block, thaw them afterwards."""
    done: list[str] = []
    try:
        for mp in mount_points:
            cmd(["fsfreeze", "-f", mp], FREEZE_TIMEOUT, "freezing the filesystem for a consistent snapshot")
            done.append(mp)
        yield
    finally:
        errors = []
        for mp in reversed(done):
            try:
                run(["fsfreeze", "-u", mp], timeout=FREEZE_TIMEOUT)
            except CommandError as e:
                errors.append(str(e))
        if errors:
            raise Internal("thawing after snapshot failed: " + "; ".join(errors))


def thaw(mount_point: str) -> bool:
    """Thaw the filesystem at ``mount_point``; True when it was frozen, False when it was not."""
    try:
        run(["fsfreeze", "-u", mount_point], timeout=FREEZE_TIMEOUT)
    except CommandError as e:
        if "Invalid argument" in e.stderr:  # EINVAL: it was not frozen
            return False
        raise Internal.from_command(e, f"thawing {mount_point}") from e
    return True


def flush_device(device: str) -> None:
    """Write a block device's buffered data through to its backing file (``blockdev --flushbufs``)."""
    cmd(["blockdev", "--flushbufs", device], FREEZE_TIMEOUT, f"flushing {device} before a snapshot")


def is_under(path: Path, base: Path) -> bool:
    """True when ``path`` (resolved without following its last component) lies strictly inside ``base``."""
    try:
        p = Path(os.path.realpath(path.parent)) / path.name
        b = Path(os.path.realpath(base))
    except OSError:
        return False
    return p != b and b in p.parents and ".." not in path.parts


def remove_under(path: Path, base: Path) -> bool:
    """Delete the file or directory ``path`` if it lies inside ``base``; False when it was already gone."""
    if not is_under(path, base):
        raise Internal(f"refusing to delete {path}: it is outside the driver's data dir {base}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    fsync_dir(path.parent)
    return True
