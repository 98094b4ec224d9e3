"""Network namespaces from the calling thread: enter one, open a netlink socket there, come back.

``setns(2)`` moves only the calling thread, so a worker thread of the agent can step into a pod's netns, open what it
needs there and return, while every other thread stays where it was. Two things are bound to the namespace that was
current when they were created, and keep working from anywhere afterwards:

- a netlink socket (a :class:`~cni.dataplane.rtnl.Rtnl` opened inside :func:`entered` talks to that netns for its
  life);
- a child process (``nft`` run from the thread inherits the thread's netns).

Files under ``/proc/sys/net`` are looked up in the netns of the *thread* that opens them, so sysctls of a pod are
written from inside :func:`entered` (``/proc/self/net`` on the other hand follows the process's main thread; use
``/proc/thread-self/net`` when a per-thread view is wanted).

Netlink libraries that open a socket in another netns for you (pyroute2's ``IPRoute(netns=...)``) fork a helper
process to do it (about 10 ms per call); entering the netns from the thread costs well under 1 ms. Python 3.11 has
no ``os.setns``, so libc's ``setns`` is called through ctypes, found among the symbols the interpreter already has
loaded (``ctypes.util.find_library`` would run ``ldconfig -p`` to look for libc, a few milliseconds per CNI exec).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
from collections.abc import Iterator

from cni.errors import INVALID_ENVIRONMENT, CniError

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3): the CLONE_NEW* type of a namespace file (Linux 4.11)
_THREAD_NETNS = "/proc/thread-self/ns/net"

_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # dlopen(NULL): the process's own symbols, libc's among them
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_netns(path: str) -> int:
    """Open a netns file (``/run/netns/NAME``, ``/proc/PID/ns/net``) for :func:`entered`; the caller closes it.

    Whatever ``path`` names, this never blocks and opens nothing else for reading: it is first opened with O_PATH
    (which neither blocks on a FIFO nor runs a device's open), checked to be a namespace file (they all live on nsfs),
    and only then opened for real through that handle; the namespace's type is checked before it is used."""
    try:
        handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {path}: no such network namespace") from None
    except OSError as e:
        raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {path}: cannot open: {e.strerror}") from None
    try:
        if os.fstat(handle).st_dev != os.stat(_THREAD_NETNS).st_dev:
            raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {path}: not a network namespace file")
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    finally:
        os.close(handle)
    try:
        kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError:
        kind = CLONE_NEWNET  # a kernel without NS_GET_NSTYPE: setns(CLONE_NEWNET) refuses any other type later
    if kind != CLONE_NEWNET:
        os.close(fd)
        raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {path}: a namespace, but not a network namespace")
    return fd


def check_netns(path: str) -> None:
    """Code 4 unless ``path`` is a network namespace other than the calling thread's own (see :func:`open_netns`)."""
    fd = open_netns(path)
    try:
        if same_netns(fd):
            raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {path} is the host's own network namespace")
    finally:
        os.close(fd)


@contextlib.contextmanager
def entered(fd: int) -> Iterator[None]:
    """Run the body with the calling thread in the netns ``fd``; the thread is returned to its own netns afterwards,
    also when the body raises. Raises OSError (EINVAL) when ``fd`` is not a network namespace."""
    home = os.open(_THREAD_NETNS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd)
        try:
            yield
        finally:
            try:
                _setns(home)
            except OSError as e:  # pragma: no cover - the kernel refusing to return to a netns we left
                raise RuntimeError(f"cannot return the thread to its network namespace: {e}") from e
    finally:
        os.close(home)


def same_netns(fd: int) -> bool:
    """True when ``fd`` is the calling thread's own netns (moving a veth peer 'into' it would be a mistake)."""
    st = os.fstat(fd)
    own = os.stat(_THREAD_NETNS)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
