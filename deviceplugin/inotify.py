"""A small inotify wrapper (libc through ctypes) that feeds the asyncio loop through ``loop.add_reader``.

No dependency: three libc calls (``inotify_init1``, ``inotify_add_watch``, ``inotify_rm_watch``) and the kernel's
event layout (``struct inotify_event``: wd, mask, cookie, len, then a NUL-padded name). The callback receives the
watched directory, the entry name and the event mask; it runs in the loop thread and must not block.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import os
import struct
from collections.abc import Callable

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

DIR_EVENTS = (
    IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ATTRIB | IN_ONLYDIR
)

_HEADER = struct.Struct("iIII")

Callback = Callable[[str, str, int], None]

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_init1.restype = ctypes.c_int
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_add_watch.restype = ctypes.c_int
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.inotify_rm_watch.restype = ctypes.c_int
        _libc = lib
    return _libc


def _oserror(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def parse_events(buf: bytes) -> list[tuple[int, int, str]]:
    """(wd, mask, name) for every event in a read buffer."""
    out = []
    off = 0
    while off + _HEADER.size <= len(buf):
        wd, mask, _cookie, length = _HEADER.unpack_from(buf, off)
        off += _HEADER.size
        name = buf[off : off + length].split(b"\0", 1)[0].decode(errors="surrogateescape")
        off += length
        out.append((wd, mask, name))
    return out


class Inotify:
    """Watches directories; call :meth:`close` when done (removes the reader and closes the fd)."""

    def __init__(self, callback: Callback) -> None:
        self._callback = callback
        self._loop = asyncio.get_running_loop()
        fd = _lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise _oserror("inotify_init1")
        self._fd = fd
        self._paths: dict[int, str] = {}
        self._wds: dict[str, int] = {}
        self.exhausted = False  # the kernel refused a watch (fs.inotify.max_user_watches reached)
        self._loop.add_reader(fd, self._readable)

    @property
    def watched(self) -> set[str]:
        return set(self._wds)

    def add(self, path: str, mask: int = DIR_EVENTS) -> bool:
        """Watch ``path``; False (no error) when it does not exist, is not a directory, or no watch is left."""
        if path in self._wds:
            return True
        wd = _lib().inotify_add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            e = ctypes.get_errno()
            if e in (errno.ENOENT, errno.ENOTDIR, errno.EACCES):
                return False
            if e == errno.ENOSPC:
                self.exhausted = True
                return False
            raise _oserror(f"inotify_add_watch {path}")
        old = self._paths.get(wd)
        if old is not None:  # the same directory under another name
            self._wds.pop(old, None)
        self._paths[wd] = path
        self._wds[path] = wd
        return True

    def remove(self, path: str) -> None:
        wd = self._wds.pop(path, None)
        if wd is not None:
            self._paths.pop(wd, None)
            _lib().inotify_rm_watch(self._fd, wd)  # EINVAL when the kernel already dropped it: fine

    def set(self, paths: set[str]) -> set[str]:
        """Watch exactly ``paths`` (those that exist); return the ones newly watched."""
        for p in self.watched - paths:
            self.remove(p)
        before = self.watched
        for p in sorted(paths):
            self.add(p)
        return self.watched - before

    def _readable(self) -> None:
        try:
            buf = os.read(self._fd, 65536)
        except OSError:  # BlockingIOError included: nothing to read after all
            return
        for wd, mask, name in parse_events(buf):
            if mask & IN_Q_OVERFLOW:
                self._callback("", "", mask)
                continue
            path = self._paths.get(wd)
            if path is None:
                continue
            if mask & IN_IGNORED:  # the directory is gone; the kernel removed the watch
                self._paths.pop(wd, None)
                if self._wds.get(path) == wd:
                    del self._wds[path]
            self._callback(path, name, mask)

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._paths.clear()
            self._wds.clear()
