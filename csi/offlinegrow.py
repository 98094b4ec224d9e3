"""Growing an unmounted ext4 filesystem to fill its device, safely against a kill -9 half-way.

Online growth (``resize2fs`` on a mounted ext4) goes through an ioctl that needs ``CAP_SYS_RESOURCE``, which an
agent in a container or a sandbox may lack; offline growth needs no capability, only an unmounted filesystem, and
``resize2fs`` requires ``e2fsck -f`` first. The node service grows offline whenever nothing but its own staging
mount holds the volume: at NodeStageVolume before mounting (a backing file that grew while the volume was not
staged, or that stage grows to the size the claim's PV gives, :mod:`csi.pvsize`), and at NodeExpandVolume when no
pod has the volume published (kubelets that expand right after staging, before publishing).

``resize2fs`` rewrites the superblock, group descriptors and bitmaps in place, so a grow killed half-way leaves a
filesystem that is neither the old one nor the new one, and whose superblock may already state the new size. A
marker file per volume (``<volume id>.growing``, written and synced before ``e2fsck``, removed once ``resize2fs``
has finished) says a grow was under way. Whoever finds the marker (the next NodeStageVolume, before anything reads
the filesystem, or the next grow) runs the grow again from the start: ``e2fsck -f -p`` repairs what the interrupted
``resize2fs`` left, and ``resize2fs`` finishes the job. With e2fsprogs 1.47 a grow killed before any one of its
writes (each injected with strace, tests/node/test_csi_offlinegrow.py) is repaired that way with every file
intact. ``resize2fs -z`` (an undo file for ``e2undo``) is not used: with 1 KiB blocks it was seen to leave an
invalid resize inode after a grow that was never interrupted. Protection is against a killed process (the agent,
its container), not a power loss, which the page cache may reorder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from csi.errors import FailedPrecondition, Internal
from nodeplug.commands import CommandError, run
from nodeplug.fsutil import fsync_dir

FSCK_TIMEOUT = 600.0
RESIZE_TIMEOUT = 600.0
FREE_WAIT = 2.0  # how long a device just unmounted may stay claimed (the kernel finishing the unmount)


class Busy(FailedPrecondition):
    """The filesystem is still mounted somewhere (another mount namespace holding a copy of the mount, say)."""


def marker_path(marker_dir: Path, volume_id: str) -> Path:
    """The marker of a grow of ``volume_id`` under way (``volume_id`` is already a checked ID)."""
    return marker_dir / f"{volume_id}.growing"


def interrupted(marker: Path) -> bool:
    """A grow of this volume was under way when its process was killed: its marker is still there."""
    return marker.exists()


def _mark(marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(marker.parent)


def _unmark(marker: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
        fsync_dir(marker.parent)


def wait_free(device: Path, wait: float = FREE_WAIT) -> None:
    """Return once nothing holds ``device`` exclusively (a mount anywhere, in any mount namespace, does); raise
    :class:`Busy` after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise Internal(f"opening {device}: {e}") from e
            if time.monotonic() >= deadline:
                raise Busy(
                    f"the filesystem on {device} is still in use (mounted in another mount namespace?); "
                    "it is grown offline once nothing holds it"
                ) from None
            time.sleep(0.05)
        else:
            os.close(fd)
            return


def check(device: Path) -> None:
    """``e2fsck -f -p``, as resize2fs requires; errors it corrected are fine, others are not."""
    try:
        run(["e2fsck", "-f", "-p", str(device)], timeout=FSCK_TIMEOUT)
    except CommandError as e:
        if e.returncode not in (1, 2):  # 1, 2: errors corrected
            raise Internal.from_command(e, f"checking the filesystem on {device} before growing it") from e


def resize(device: Path) -> None:
    """:func:`check`, then ``resize2fs`` to fill ``device``: the grow itself, with no marker (also for a volume's copy
    no one uses yet, whose interrupted grow leaves nothing behind but the copy)."""
    check(device)
    try:
        run(["resize2fs", str(device)], timeout=RESIZE_TIMEOUT)
    except CommandError as e:
        raise Internal.from_command(e, f"growing the filesystem on {device}") from e


def grow(device: Path, marker: Path) -> bool:
    """Grow the unmounted ext4 on ``device`` to fill it (after an interrupted grow too). Returns whether an
    interrupted grow was found. A failure keeps the marker: the next stage or grow starts over."""
    wait_free(device)
    was = interrupted(marker)
    _mark(marker)
    resize(device)
    _unmark(marker)
    return was
