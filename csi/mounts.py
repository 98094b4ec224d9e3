"""Mounts as the node service needs them: read the mount table, mount, bind, remount read-only, unmount, statvfs.

The truth about what is mounted where is ``/proc/self/mountinfo`` (never a record of our own): every function that
asks "is this mounted?" reads it, so a restart or a reboot cannot make us believe a stale answer. Mount points in
mountinfo are canonical absolute paths with space, tab, newline and backslash escaped as octal (``\\040``); callers
pass resolved paths. Every change goes through ``nodeplug.commands.run`` (``mount``/``umount`` from util-linux, an
argument list and a timeout), so a failure names the command and its stderr. These functions block: the node service
calls them through ``asyncio.to_thread``.

Filesystem health (:func:`fs_problem`) looks where the kernel reports it: ext4's ``errors_count`` in sysfs, a
filesystem that the kernel remounted read-only after an error (``errors=remount-ro``), and ``statvfs`` failing with
EIO (an XFS shutdown).
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeplug.commands import CommandError, run

MOUNTINFO = Path("/proc/self/mountinfo")
MOUNT_TIMEOUT = 60.0
SYS_FS = Path("/sys/fs")


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo."""

    mount_id: int
    parent_id: int
    dev: str  # "major:minor" of the filesystem
    root: str  # the path inside the filesystem that is mounted here ("/" or a bind source)
    mount_point: str
    options: tuple[str, ...]  # per-mount options: rw/ro, nosuid, nodev, ...
    fs_type: str
    source: str
    super_options: tuple[str, ...]  # per-superblock options

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        c = field[i]
        if c == "\\" and i + 3 < len(field) and all(d in "01234567" for d in field[i + 1 : i + 4]):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse mountinfo text (proc(5)): optional fields end at a lone ``-``."""
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 10:
            continue
        try:
            sep = parts.index("-", 6)
        except ValueError:
            continue
        if len(parts) < sep + 3:
            continue
        entries.append(
            MountEntry(
                mount_id=int(parts[0]),
                parent_id=int(parts[1]),
                dev=parts[2],
                root=_unescape(parts[3]),
                mount_point=_unescape(parts[4]),
                options=tuple(parts[5].split(",")),
                fs_type=parts[sep + 1],
                source=_unescape(parts[sep + 2]),
                super_options=tuple(parts[sep + 3].split(",")) if len(parts) > sep + 3 else (),
            )
        )
    return entries


def mount_table(path: Path = MOUNTINFO) -> list[MountEntry]:
    return parse_mountinfo(path.read_text())


def find_mount(target: Path | str, table: Sequence[MountEntry] | None = None) -> MountEntry | None:
    """The mount visible at ``target`` (the last one stacked there), or None when nothing is mounted there."""
    want = str(target)
    found = None
    for e in table if table is not None else mount_table():
        if e.mount_point == want:
            found = e
    return found


def is_mounted(target: Path | str, table: Sequence[MountEntry] | None = None) -> bool:
    return find_mount(target, table) is not None


def mounts_under(prefix: Path | str, table: Sequence[MountEntry] | None = None) -> list[MountEntry]:
    """Every mount at or below ``prefix``."""
    p = str(prefix).rstrip("/")
    return [
        e
        for e in (table if table is not None else mount_table())
        if e.mount_point == p or e.mount_point.startswith(p + "/")
    ]


def mount(
    source: str | Path,
    target: Path,
    fs_type: str | None = None,
    options: Iterable[str] = (),
    timeout: float = MOUNT_TIMEOUT,
) -> None:
    """``mount [-t TYPE] [-o OPTS] SOURCE TARGET``."""
    argv = ["mount"]
    if fs_type:
        argv += ["-t", fs_type]
    opts = [o for o in options if o]
    if opts:
        argv += ["-o", ",".join(opts)]
    argv += ["--", str(source), str(target)]
    run(argv, timeout)


def bind_mount(source: str | Path, target: Path, readonly: bool = False, flags: Iterable[str] = ()) -> None:
    """Bind ``source`` onto ``target``; then, when read-only or flags are asked for, remount the bind with them.

    A bind mount ignores most options on the first call, so read-only and per-mount flags (nosuid, noexec, ...) take
    a second ``mount -o remount,bind,...``. If that second step fails the bind is undone, so nothing is left
    half-done.
    """
    run(["mount", "--bind", "--", str(source), str(target)], MOUNT_TIMEOUT)
    extra = [f for f in flags if f and f not in ("bind", "rw", "ro")]
    if readonly or extra:
        opts = ["remount", "bind", "ro" if readonly else "rw", *extra]
        try:
            run(["mount", "-o", ",".join(opts), "--", str(target)], MOUNT_TIMEOUT)
        except CommandError:
            unmount_top(target)
            raise


def unmount_top(target: Path | str, timeout: float = MOUNT_TIMEOUT) -> None:
    """Unmount the mount on top at ``target`` (one ``umount``); nothing mounted there (any more) is fine.

    ``umount -i`` never runs a ``/sbin/umount.<type>`` helper named by the mount's options: the mounts unmounted
    here are the driver's own (ext4, xfs, btrfs, binds), which need none.
    """
    try:
        run(["umount", "-i", "--", str(target)], timeout)
    except CommandError:
        if is_mounted(target):
            raise


def unmount(target: Path, timeout: float = MOUNT_TIMEOUT) -> bool:
    """Unmount everything stacked at ``target``; True if something was unmounted, False if nothing was mounted."""
    did = False
    for _ in range(16):
        if not is_mounted(target):
            return did
        unmount_top(target, timeout)
        did = True
    raise CommandError(["umount", str(target)], "left mounts stacked after 16 attempts")


@dataclass(frozen=True)
class FsStats:
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int
    free_inodes: int
    used_inodes: int


def fs_stats(path: Path) -> FsStats:
    """statvfs of the mounted filesystem at ``path``; raises OSError (EIO on a shut-down filesystem)."""
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    avail = st.f_bavail * st.f_frsize
    used = max(0, (st.f_blocks - st.f_bfree) * st.f_frsize)
    return FsStats(
        total_bytes=total,
        available_bytes=avail,
        used_bytes=used,
        total_inodes=st.f_files,
        free_inodes=st.f_ffree,
        used_inodes=max(0, st.f_files - st.f_ffree),
    )


def block_size(path: str | Path) -> int:
    """Size in bytes of the block device (or file) at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def _sysfs_dev_name(entry: MountEntry) -> str:
    return Path(entry.source).name


def fs_problem(entry: MountEntry, expect_rw: bool = True, sys_fs: Path = SYS_FS) -> str | None:
    """A sentence describing a filesystem error on the mount, or None when the kernel reports none."""
    if entry.fs_type == "ext4":
        counter = sys_fs / "ext4" / _sysfs_dev_name(entry) / "errors_count"
        try:
            n = int(counter.read_text().strip() or "0")
        except (OSError, ValueError):
            n = 0
        if n > 0:
            return f"ext4 on {entry.source} has recorded {n} error(s): run fsck after unstaging"
    if expect_rw and "ro" in entry.super_options:
        return f"{entry.fs_type} on {entry.source} was remounted read-only by the kernel after an error"
    try:
        os.statvfs(entry.mount_point)
    except OSError as e:
        if e.errno == errno.EIO:
            return f"{entry.fs_type} on {entry.source} returns I/O errors (filesystem shut down)"
        return f"cannot stat the filesystem at {entry.mount_point}: {e.strerror}"
    return None


def fs_size(device: str | Path, fs_type: str) -> int | None:
    """Bytes the ext4 or xfs filesystem on ``device`` spans, read from its superblock; None when unknown.

    Used to notice a volume that was grown while it was not staged (device larger than its filesystem).
    """
    try:
        with open(device, "rb") as f:
            if fs_type == "ext4":
                f.seek(1024)
                sb = f.read(1024)
                if len(sb) < 0x154 or struct.unpack_from("<H", sb, 0x38)[0] != 0xEF53:
                    return None
                lo, log_block = struct.unpack_from("<I", sb, 4)[0], struct.unpack_from("<I", sb, 24)[0]
                incompat = struct.unpack_from("<I", sb, 0x60)[0]
                hi = struct.unpack_from("<I", sb, 0x150)[0] if incompat & 0x80 else 0  # INCOMPAT_64BIT
                return int((lo | hi << 32) * (1024 << log_block))
            if fs_type == "xfs":
                sb = f.read(16)
                if len(sb) < 16 or sb[:4] != b"XFSB":
                    return None
                block, dblocks = struct.unpack_from(">IQ", sb, 4)
                return int(block * dblocks)
    except OSError:
        return None
    return None
