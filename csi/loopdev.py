"""Loop devices over backing files, through ``losetup`` (argument lists, timeouts).

Loop devices do not survive a reboot and are not recorded as truth anywhere: :func:`find` asks the kernel which
device (if any) is attached to a backing file, and :func:`attach` reuses that one, so staging the same volume twice,
or again after an agent restart, never attaches a second device. Errors are :class:`csi.errors.Internal` naming the
command and its stderr.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from csi.errors import Internal
from nodeplug.commands import CommandError, run

TIMEOUT = 30.0
RELEASE_WAIT = 10.0


def _losetup(*args: str) -> str:
    try:
        return run(["losetup", *args], timeout=TIMEOUT)
    except CommandError as e:
        raise Internal.from_command(e) from e


def find(backing: Path) -> str | None:
    """The loop device attached to ``backing`` (first one by name), or None."""
    target = os.path.realpath(backing)
    out = _losetup("-J", "-l", "-O", "NAME,BACK-FILE")
    if not out.strip():
        return None
    found = []
    for dev in json.loads(out).get("loopdevices", []):
        back = (dev.get("back-file") or "").removesuffix(" (deleted)")
        if back == target:
            found.append(str(dev["name"]))
    return sorted(found, key=lambda n: (len(n), n))[0] if found else None


def attach(backing: Path, direct_io: bool = False) -> str:
    """Attach ``backing`` to a free loop device (or return the one already attached) and return its path."""
    existing = find(backing)
    if existing:
        return existing
    args = ["-f", "--show"]
    if direct_io:
        args.append("--direct-io=on")
    dev = _losetup(*args, str(backing)).strip()
    if not dev.startswith("/dev/loop"):
        raise Internal(f"losetup -f --show {backing}: unexpected output {dev!r}")
    return dev


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
    name = os.path.basename(device)
    try:
        return Path(f"/sys/block/{name}/loop/backing_file").read_text().strip().removesuffix(" (deleted)")
    except OSError:
        return None
