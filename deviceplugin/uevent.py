"""Kernel uevents (NETLINK_KOBJECT_UEVENT) for sysfs hotplug: a PCI function or USB device added or removed.

inotify does not fire on sysfs, so PCI and USB resources learn of hotplug from the kernel's uevent broadcast (the
same messages udev reads). Each message is ``ACTION@DEVPATH`` followed by NUL-separated ``KEY=VALUE`` pairs; the
callback gets the action and the key/value dict. Opening the socket can fail (no netlink in a sandbox, a network
namespace without uevents); the caller then relies on inotify for /dev and the slow safety re-scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1

Callback = Callable[[str, dict[str, str]], None]


def parse(msg: bytes) -> tuple[str, dict[str, str]] | None:
    """(action, fields) of a kernel uevent; None for anything else (e.g. udev's own ``libudev`` messages)."""
    parts = msg.split(b"\0")
    head = parts[0].decode(errors="replace")
    if "@" not in head:
        return None
    fields: dict[str, str] = {}
    for p in parts[1:]:
        k, sep, v = p.decode(errors="replace").partition("=")
        if sep:
            fields[k] = v
    return fields.get("ACTION", head.split("@", 1)[0]), fields


class UeventMonitor:
    def __init__(self, callback: Callback) -> None:
        self._callback = callback
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, NETLINK_KOBJECT_UEVENT)
        try:
            sock.bind((0, KERNEL_GROUP))  # port id 0: the kernel picks one
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                msg = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ENOBUFS after an overflow: report it as an unknown change
                self._callback("overflow", {})
                return
            parsed = parse(msg)
            if parsed is not None:
                self._callback(*parsed)

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
