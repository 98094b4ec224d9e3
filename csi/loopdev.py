"""Loop devices over backing files, through ``losetup`` (argument lists, timeouts).

Loop devices do not survive a reboot and are not recorded as truth anywhere: :func:`devices_of` asks the kernel
(sysfs) which devices are attached to a backing file, and :func:`attach_rw` reuses the read-write one, so staging the
same volume twice, or again after an agent restart, never attaches a second device. Read-only devices (made for
read-only block publishes) are never reused for staging. Errors are :class:`csi.errors.Internal` naming the command
and its stderr.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

from csi.errors import Internal
from nodeplug.commands import CommandError, run

TIMEOUT = 30.0
SYS_BLOCK = Path("/sys/block")
RELEASE_WAIT = 10.0


def _losetup(*args: str) -> str:
    try:
        return run(["losetup", *args], timeout=TIMEOUT)
    except CommandError as e:
        raise Internal.from_command(e) from e


LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = struct.Struct("=QQ")  # struct loop_info64 begins with lo_device, lo_inode (the backing file's)


def _backing_id(device: str) -> tuple[int, int] | None:
    """(device, inode) of the file ``device`` is attached to, from the kernel (LOOP_GET_STATUS64)."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(232))
    except OSError:
        return None
    finally:
        os.close(fd)
    dev, ino = _LOOP_INFO64.unpack_from(info)
    return int(dev), int(ino)


def attached_to(device: str, name: str, backing: Path) -> bool:
    """Whether loop ``device``, whose backing file sysfs names ``name``, is attached to the file ``backing``.

    sysfs names the backing file by its path as seen through the mount it was opened through, which says little:
    - when that mount is gone (the agent's container, and with it its mount of the host's state directory, ended
      since: an agent restart), the name is only the part below that mount (``/csi/volumes/<id>.img``);
    - another mount namespace's file has the very same name when that namespace mounts something else at the same
      path (several nodes on one machine, each with its own ``/var/lib/nodeplug``; loop devices are machine-wide).
    So a device whose name is the file's path, or ends with it, is this file's only when the kernel says it is
    attached to this file's device and inode (LOOP_GET_STATUS64)."""
    want = os.path.realpath(backing)
    return _attached(device, name, want, _file_id(want))


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _attached(device: str, name: str, want: str, want_id: tuple[int, int] | None) -> bool:
    """:func:`attached_to` with the backing file's real path ``want`` and its (device, inode) resolved once by the
    caller."""
    if name != want and (not want.endswith(name) or os.path.basename(name) != os.path.basename(want)):
        return False
    if want_id is None:
        # The file is gone (deleted while attached): the kernel's word that this device holds a deleted file of
        # exactly this name is all that is left to go by.
        return name == want and _holds_deleted(device)
    return _backing_id(device) == want_id


def _holds_deleted(device: str) -> bool:
    try:
        raw = (SYS_BLOCK / os.path.basename(device) / "loop" / "backing_file").read_text()
    except OSError:
        return False
    return raw.strip().endswith(" (deleted)")


def _backing_name(loop_dir: Path) -> str:
    """The backing file sysfs names in a loop device's directory (``/sys/block/loopN``); OSError when not attached."""
    return (loop_dir / "loop" / "backing_file").read_text().strip().removesuffix(" (deleted)")


def _read_only(loop_dir: Path) -> bool:
    """Whether sysfs says the loop device in ``loop_dir`` is read-only; OSError when it is gone."""
    return (loop_dir / "ro").read_text().strip() == "1"


def attached(sys_block: Path = SYS_BLOCK) -> list[tuple[str, str]]:
    """Every attached loop device as (device, backing file as sysfs names it): one pass over sysfs, for a caller
    that asks about many backing files (pass it to :func:`devices_of`)."""
    found = []
    for d in sys_block.glob("loop*"):
        try:
            found.append((f"/dev/{d.name}", _backing_name(d)))
        except OSError:
            continue
    return found


def devices_of(
    backing: Path, sys_block: Path = SYS_BLOCK, devices: list[tuple[str, str]] | None = None
) -> list[tuple[str, bool]]:
    """Every loop device attached to ``backing``, as (device, read-only), from sysfs (no command run; a device whose
    name only ends like the file's is checked by :func:`attached_to`). ``devices``: :func:`attached`, already read."""
    want = os.path.realpath(backing)  # once: a host with many volumes has as many attached devices to compare
    want_id = _file_id(want)
    found = []
    for dev, name in devices if devices is not None else attached(sys_block):
        try:
            if _attached(dev, name, want, want_id):
                found.append((dev, _read_only(sys_block / os.path.basename(dev))))
        except OSError:
            continue
    return sorted(found, key=lambda x: (len(x[0]), x[0]))


def device_of_number(number: int, sys_dev_block: Path = Path("/sys/dev/block")) -> tuple[str, str] | None:
    """(loop device, its backing file) for a device number (``st_dev``/``st_rdev``), or None when that number is not
    an attached loop device. One sysfs lookup, whatever the number of loop devices on the host."""
    node = sys_dev_block / f"{os.major(number)}:{os.minor(number)}"
    try:
        back = _backing_name(node)
    except OSError:
        return None
    return f"/dev/{os.path.basename(os.path.realpath(node))}", back


def is_read_only(device: str) -> bool:
    """True when the loop device was attached read-only (``losetup -r``)."""
    try:
        return _read_only(SYS_BLOCK / os.path.basename(device))
    except OSError:
        return False


def rw_device(backing: Path, devices: list[tuple[str, str]] | None = None) -> str | None:
    """The read-write loop device of ``backing`` (the staged one), ignoring read-only ones made for publishing.
    ``devices``: :func:`attached`, already read."""
    return next((dev for dev, ro in devices_of(backing, devices=devices) if not ro), None)


def attach_rw(backing: Path) -> str:
    """The read-write loop device of ``backing``, attaching one when there is none."""
    return attach(backing)[0]


def attach(backing: Path, read_only: bool = False) -> tuple[str, bool]:
    """A loop device over ``backing`` and whether this call attached it: the read-write one is reused when there is
    one; a read-only one (``read_only``) is always new."""
    dev = None if read_only else rw_device(backing)
    if dev is not None:
        return dev, False
    argv = ["losetup", *(["-r"] if read_only else []), "-f", "--show", str(backing)]
    try:
        dev = run(argv, timeout=TIMEOUT).strip()
    except CommandError as e:
        raise Internal.from_command(e, f"attaching {backing.name}") from e
    if not dev.startswith("/dev/loop"):
        raise Internal(f"{' '.join(argv)}: unexpected output {dev!r}")
    return dev, True


def detach(device: str, wait: float = RELEASE_WAIT) -> None:
    """Detach ``device`` and wait until the kernel has let go of its backing file; already gone is fine.

    ``losetup -d`` on a device something still holds open (udev probing it, a mount) only marks it for
    auto-clear and returns at once; waiting here means a caller that detaches and then deletes or re-attaches
    the backing file sees the device really gone. A device still attached after ``wait`` seconds is INTERNAL.
    """
    if not device.startswith("/dev/loop"):
        raise Internal(f"refusing to detach {device!r}: not a loop device")
    backing = backing_file(device)
    try:
        run(["losetup", "-d", device], timeout=TIMEOUT)
    except CommandError as e:
        if "No such device" in e.stderr or "No such file" in e.stderr:
            return
        raise Internal.from_command(e) from e
    deadline = time.monotonic() + wait
    while backing is not None and backing_file(device) == backing:
        if time.monotonic() >= deadline:
            raise Internal(f"losetup -d {device}: still attached to {backing} after {wait:g}s: it is in use")
        time.sleep(0.02)


def refresh_size(device: str) -> None:
    """Make the loop device pick up a grown backing file (``losetup -c``)."""
    _losetup("-c", device)


def backing_file(device: str) -> str | None:
    """The backing file of ``device`` from sysfs, or None when it is not attached."""
    try:
        return _backing_name(SYS_BLOCK / os.path.basename(device))
    except OSError:
        return None
