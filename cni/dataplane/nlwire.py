"""The netlink wire format every socket of nodeplug speaks (rtnetlink in :mod:`cni.dataplane.rtnl`, nfnetlink in
:mod:`cni.policy.nfsets`, the cluster network's lean parsers in :mod:`cni.cluster.rawnl`), in one place.

A datagram holds messages, each an ``nlmsghdr`` (length, type, flags, sequence number, port id) and a body, 4-byte
aligned; a body is a family header (``ifinfomsg``, ``rtmsg``, ``nfgenmsg``...) and attributes, each an ``nlattr``
(length, type) and a value, 4-byte aligned too. Numbers from the kernel's ``linux/netlink.h`` and ``rtnetlink.h``.

Reading never trusts a length: a message or attribute whose length is too small or runs past its end stops the walk
there; nothing here raises on the kernel's bytes.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator

NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_REPLACE = 0x100
NLM_F_CAPPED = 0x100  # in an error answer: the failed request is echoed by its header only
NLM_F_EXCL = 0x200
NLM_F_ACK_TLVS = 0x200  # in an error answer: extended ACK attributes follow
NLM_F_CREATE = 0x400
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLMSG_OVERRUN = 4
NLA_F_NESTED = 1 << 15
NLA_TYPE_MASK = 0x3FFF  # without the nested and byte-order flags

SOL_NETLINK = 270
NETLINK_CAP_ACK = 10  # errors echo only the header of the failed request, not all of it
NETLINK_EXT_ACK = 11  # errors carry the kernel's message

NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence number, port id
NLATTR = struct.Struct("=HH")  # length, type
IFINFOMSG = struct.Struct("=BxHiII")  # family, (pad), type, index, flags, change
IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
NDMSG = struct.Struct("=BxxxiHBB")  # family, (pad), ifindex, state, flags, type


def align(n: int) -> int:
    return (n + 3) & ~3


def message(msg_type: int, flags: int, seq: int, body: bytes) -> bytes:
    """One message: its header (port id 0: the kernel's), then ``body``."""
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), msg_type, flags, seq, 0) + body


def attr(kind: int, value: bytes) -> bytes:
    """One attribute, padded."""
    return NLATTR.pack(NLATTR.size + len(value), kind) + value + b"\0" * (-len(value) % 4)


def messages(buf: memoryview | bytes) -> Iterator[tuple[int, int, int, memoryview]]:
    """Split one datagram into ``(type, flags, sequence number, whole message)``."""
    view = memoryview(buf)
    offset = 0
    while offset + NLMSGHDR.size <= len(view):
        length, msg_type, flags, seq, _ = NLMSGHDR.unpack_from(view, offset)
        if length < NLMSGHDR.size or offset + length > len(view):
            break
        yield msg_type, flags, seq, view[offset : offset + length]
        offset += align(length)


def attrs(data: bytes | memoryview, offset: int) -> Iterator[tuple[int, int, int]]:
    """The attributes in ``data`` from ``offset`` as ``(type without flags, value start, value end)``."""
    while offset + NLATTR.size <= len(data):
        length, kind = NLATTR.unpack_from(data, offset)
        if length < NLATTR.size or offset + length > len(data):
            break
        yield kind & NLA_TYPE_MASK, offset + NLATTR.size, offset + length
        offset += align(length)


def open_socket(protocol: int, timeout: float) -> socket.socket:
    """A blocking netlink socket of ``protocol`` in the calling thread's netns, bound, asking for capped and
    extended ACKs where the kernel has them; every send and receive ends after ``timeout`` seconds (the kernel's
    own timeouts: ``settimeout`` would add a poll() before every call)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)
    try:
        for option in (NETLINK_CAP_ACK, NETLINK_EXT_ACK):
            with contextlib.suppress(OSError):  # older kernels: plain errno answers
                sock.setsockopt(SOL_NETLINK, option, 1)
        sock.bind((0, 0))
        limit = struct.pack("@ll", int(timeout), int(timeout % 1 * 1_000_000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    except BaseException:
        sock.close()
        raise
    return sock
