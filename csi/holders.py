"""Whether a path on the host holds a given volume: the check before the Node service uses or removes a mount.

A mount found at a staging or target path is used (adopted by a repeat stage or publish) or unmounted only when it is
provably this volume's, and the proof comes from the kernel, never from names, paths or records:

- a loop-file filesystem volume: the filesystem at the path lives on a loop device attached to the volume's backing
  file (``st_dev`` of the path is a loop device whose backing file, in sysfs, is the volume's);
- a btrfs subvolume: the path is the subvolume itself or a bind of it (same ``st_dev`` and ``st_ino`` as the
  subvolume's directory; every subvolume has a device number of its own);
- a block volume: the path is a block device node whose device number is a loop device over the backing file (the
  staged one, or a read-only one made for a read-only publish).

One ``stat`` and one sysfs read (``/sys/dev/block/<major>:<minor>``) per question, however many loop devices the
host has.

``os.stat`` of a mount point sees the root of what is mounted there (the top of a stack). These functions block
(stat, sysfs): the Node service calls them from worker threads.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from csi import loopdev, mounts
from csi.model import Volume


def _loop_over(number: int, backing: Path) -> str | None:
    """The loop device with device number ``number`` when its backing file is ``backing``, else None (also after
    the agent's restart, when sysfs names the file only below the previous container's mount:
    :func:`loopdev.attached_to`)."""
    found = loopdev.device_of_number(number)
    return found[0] if found is not None and loopdev.attached_to(found[0], found[1], backing) else None


def holds(v: Volume, backing: Path, path: Path | str) -> bool:
    """True when what is visible at ``path`` is volume ``v`` (whose bytes are at ``backing``)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if v.is_subvolume:
        try:
            own = os.stat(backing)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
    if v.is_block:
        return stat.S_ISBLK(st.st_mode) and _loop_over(st.st_rdev, backing) is not None
    return _loop_over(st.st_dev, backing) is not None


def mounted(v: Volume, backing: Path, path: Path | str, table: Sequence[mounts.MountEntry] | None = None) -> bool:
    """True when something is mounted at ``path`` (in ``table``, else the mount table now) and it is volume ``v``."""
    return mounts.is_mounted(path, table) and holds(v, backing, path)


def loop_device_at(v: Volume, backing: Path, path: Path | str) -> str | None:
    """The loop device of volume ``v`` whose node is mounted at ``path`` (a block publish), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _loop_over(st.st_rdev, backing) if stat.S_ISBLK(st.st_mode) else None
