"""Kernel parameters through ``/proc/sys``, in the netns of the calling thread.

``/proc/sys/net`` resolves against the netns of the thread that opens the file, so a thread inside
:func:`cni.dataplane.netns.entered` sets the pod's parameters and any other thread sets the host's. Values are read
first and written only when they differ: most ADDs find forwarding already on and write nothing.
"""

from __future__ import annotations

from cni.errors import DATAPLANE, CniError

_ROOT = "/proc/sys/"


def _path(key: str) -> str:
    return _ROOT + key.replace(".", "/") if "/" not in key else _ROOT + key


def read(key: str) -> str | None:
    """The value of ``key`` (``net.ipv4.ip_forward`` or ``net/ipv6/conf/eth0/accept_dad``); None when absent."""
    try:
        with open(_path(key), "rb", buffering=0) as f:  # unbuffered bytes: no text layer set up for two bytes
            return f.read(4096).decode(errors="replace").strip()
    except FileNotFoundError:
        return None


def ensure(key: str, value: str, missing_ok: bool = False) -> None:
    """Set ``key`` to ``value`` unless it already is; CniError naming the key when it cannot be written."""
    try:
        current = read(key)
    except OSError as e:
        raise CniError(DATAPLANE, details=f"sysctl {key}: cannot read: {e.strerror}") from None
    if current is None:
        if missing_ok:
            return
        raise CniError(DATAPLANE, details=f"sysctl {key}: not present in this kernel or network namespace")
    if current == value:
        return
    try:
        with open(_path(key), "w") as f:
            f.write(value)
    except OSError as e:
        raise CniError(DATAPLANE, details=f"sysctl {key}={value}: cannot write: {e.strerror}") from None


def conf_key(family: int, ifname: str, name: str) -> str:
    """``net/ipv6/conf/<ifname>/<name>`` (slashes: an interface name may contain dots)."""
    return f"net/ipv{family}/conf/{ifname}/{name}"
