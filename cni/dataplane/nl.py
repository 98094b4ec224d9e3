"""Netlink helpers over pyroute2: sockets, lookups and turning kernel errors into CNI errors.

One :class:`~pyroute2.IPRoute` per side per call (the host side is the calling thread's netns; the pod side is opened
from inside the pod's netns, see :mod:`cni.dataplane.netns`). pyroute2's synchronous API runs its own event loop in the
calling thread, so these functions are called from worker threads, never from a running event loop.
"""

from __future__ import annotations

import errno
import ipaddress
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cni.dataplane.netns import entered
from cni.errors import DATAPLANE, CniError

IFF_UP = 0x1
IFF_PROMISC = 0x100
IFA_F_NODAD = 0x02
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
AF_INET = 2
AF_INET6 = 10

__all__ = ["IPRoute", "NetlinkError"]


def nl_error(what: str, e: BaseException) -> CniError:
    """``what`` failed: a CniError (code 101) carrying the kernel's reason."""
    if isinstance(e, NetlinkError):
        reason = os.strerror(e.code) if e.code else str(e)
    elif isinstance(e, OSError) and e.errno:
        reason = e.strerror or os.strerror(e.errno)
    else:
        reason = str(e)
    return CniError(DATAPLANE, details=f"{what}: {reason}")


@contextmanager
def host_socket() -> Iterator[Any]:
    """A netlink socket in the calling thread's netns."""
    try:
        ipr = IPRoute()
    except OSError as e:
        raise nl_error("open a netlink socket", e) from None
    try:
        yield ipr
    finally:
        ipr.close()


@contextmanager
def socket_in(nsfd: int, netns: str, inside: Callable[[], None] | None = None) -> Iterator[Any]:
    """A netlink socket bound to the netns ``nsfd``, opened by this thread from inside it. ``inside`` runs there too
    (for sysctls of the pod), so one trip into the netns serves both."""
    try:
        with entered(nsfd):
            ipr = IPRoute()
            try:
                if inside is not None:
                    inside()
            except BaseException:
                ipr.close()
                raise
    except OSError as e:
        raise nl_error(f"enter the network namespace {netns}", e) from None
    try:
        yield ipr
    finally:
        ipr.close()


def get_link(ipr: Any, name: str) -> Any | None:
    """The RTM_NEWLINK message of ``name``, or None when there is no such link."""
    try:
        return ipr.link("get", ifname=name)[0]
    except NetlinkError as e:
        if e.code == errno.ENODEV:
            return None
        raise


def link_kind(msg: Any) -> str:
    kind = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND")
    return str(kind) if kind else ""


def random_mac() -> str:
    """A random locally administered unicast MAC address."""
    b = bytearray(os.urandom(6))
    b[0] = (b[0] & 0xFE) | 0x02
    return ":".join(f"{x:02x}" for x in b)


def addr_args(iface: ipaddress.IPv4Interface | ipaddress.IPv6Interface) -> dict[str, Any]:
    """Keyword arguments for ``ipr.addr('add', ...)``: broadcast on IPv4 (as ip(8) and the Go netlink do), no DAD on
    IPv6 (the address is usable at once)."""
    args: dict[str, Any] = {"address": str(iface.ip), "prefixlen": iface.network.prefixlen}
    if iface.version == 4:
        if iface.network.prefixlen < 31:
            args["broadcast"] = str(iface.network.broadcast_address)
    else:
        args["flags"] = IFA_F_NODAD
    return args


def addresses(ipr: Any, index: int) -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    """The addresses on link ``index`` as interfaces (address/prefix)."""
    out: list[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = []
    for msg in ipr.addr("dump", index=index):
        a = msg.get("IFA_ADDRESS")
        if a:
            out.append(ipaddress.ip_interface(f"{a}/{msg['prefixlen']}"))
    return out
