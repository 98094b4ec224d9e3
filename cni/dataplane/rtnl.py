"""A synchronous rtnetlink socket: the messages of :mod:`cni.dataplane.messages` over a plain ``AF_NETLINK`` socket.

The transport (:class:`Rtnl`): one request at a time per socket, each with its own sequence number; the kernel's
answer is read until its ACK (``NLMSG_ERROR`` with code 0), its error, or the end of a dump (``NLMSG_DONE``). Errors
carry the kernel's extended ACK message when it sends one (``NETLINK_EXT_ACK``), e.g. "Invalid prefix for given
prefix length". A dump the kernel marks interrupted (``NLM_F_DUMP_INTR``: the table changed while it was read) is read
again. A socket is bound to the network namespace of the thread that opens it, for its whole life. Every send and
receive has a deadline (:data:`TIMEOUT`): a kernel that does not answer in time (RTNL held elsewhere for that long)
is a NetlinkError ETIMEDOUT, which the dataplane reports as try-again-later.

Standard library only. pyroute2's ``IPRoute`` was the transport once: importing its package runs an ``__init__`` of
351 modules (120-150 ms on a 2-core node) and it runs an asyncio event loop per instance, both paid by every
standalone CNI exec; its message classes went the same way later (:mod:`cni.dataplane.messages` says why).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from typing import TypeVar

from cni.dataplane import nlwire
from cni.dataplane.messages import Message
from cni.dataplane.nlwire import (
    NLM_F_ACK,
    NLM_F_ACK_TLVS,
    NLM_F_CAPPED,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_NOOP,
    NLMSG_OVERRUN,
    NLMSGHDR,
)

M = TypeVar("M", bound=Message)

RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK, RTM_SETLINK = 16, 17, 18, 19
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWNEIGH, RTM_DELNEIGH, RTM_GETNEIGH = 28, 29, 30


class NetlinkError(Exception):
    """The kernel refused a request (or did not answer in time): ``code`` is the errno, ``args[1]`` the reason."""

    def __init__(self, code: int, msg: str | None = None, index: int = 0) -> None:
        super().__init__(code, msg or os.strerror(code))
        self.code = code
        self.index = index  # which request of a batch (:meth:`Rtnl.ack_batch`) was refused


NLMSGERR_ATTR_MSG = 1
_ERRNO = struct.Struct("=i")  # struct nlmsgerr's error
_DUMP_ATTEMPTS = 5
TIMEOUT = 15.0  # seconds one send or receive may take
_RECV_SIZE = 1 << 16


class Rtnl:
    """A NETLINK_ROUTE socket in the netns of the thread that opened it. Not thread-safe: one per thread."""

    def __init__(self) -> None:
        self._sock = nlwire.open_socket(socket.NETLINK_ROUTE, TIMEOUT)
        self._seq = 0
        self._buf = bytearray(_RECV_SIZE)

    def close(self) -> None:
        self._sock.close()

    # ------------------------------------------------------------ requests

    def ack(self, msg: Message, msg_type: int, flags: int = 0) -> None:
        """Send ``msg`` as ``msg_type`` and wait for the kernel's ACK; :class:`NetlinkError` when it refuses."""
        seq = self._send(msg, msg_type, NLM_F_REQUEST | NLM_F_ACK | flags)
        for _ in self._replies(seq, done_at_ack=True, small=True):
            pass

    def ack_batch(self, requests: Sequence[tuple[Message, int, int]]) -> None:
        """Send ``requests`` (message, type, flags) in one datagram and wait until the kernel has run them all: it runs
        them in order, each whatever became of the ones before, and answers only the last with an ACK (the others
        answer only when refused). :class:`NetlinkError` of the first refused, its ``index`` naming it. One system
        call each way instead of two per request: each is a moment the agent's threads hand the GIL to one another."""
        if not requests:
            return
        first = self._seq % 0x7FFFFFFF + 1
        last = first + len(requests) - 1
        if last > 0x7FFFFFFF:
            first, last = 1, len(requests)
        self._seq = last
        data = b"".join(
            msg.encode(msg_type, NLM_F_REQUEST | flags | (NLM_F_ACK if seq == last else 0), seq)
            for seq, (msg, msg_type, flags) in enumerate(requests, first)
        )
        try:
            self._sock.send(data)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise NetlinkError(errno.ETIMEDOUT, f"the kernel took no request within {TIMEOUT:g}s") from None
        refused: NetlinkError | None = None
        while True:
            n = self._recv(small=True)
            for msg_type, flags, msg_seq, msg_data in nlwire.messages(memoryview(self._buf)[:n]):
                if msg_type != NLMSG_ERROR or not first <= msg_seq <= last:
                    continue
                code, text = error_of(flags, msg_data)
                if code and (refused is None or msg_seq - first < refused.index):
                    refused = NetlinkError(code, text, index=msg_seq - first)
                if msg_seq == last:
                    if refused is not None:
                        raise refused
                    return

    def get(self, msg: Message, msg_type: int, reply: type[M]) -> M:
        """Send a GET request that has one answer (e.g. a link by name) and return it, decoded as ``reply``."""
        seq = self._send(msg, msg_type, NLM_F_REQUEST)
        for _, data in self._replies(seq, done_at_ack=False, first_only=True):
            return _decoded(reply, data)
        raise NetlinkError(errno.ENODATA, f"no answer to netlink request type {msg_type}")

    def dump(self, msg: Message, msg_type: int, reply: type[M]) -> list[M]:
        """Send a DUMP request and return every answer decoded as ``reply`` (read again while interrupted)."""
        return [_decoded(reply, data) for data in self.dump_raw(msg, msg_type)]

    def dump_raw(self, msg: Message, msg_type: int) -> list[bytes]:
        """Send a DUMP request and return every answer as the message's bytes (netlink header included), for a
        caller that reads a few fields of thousands of answers without decoding each whole."""
        for _ in range(_DUMP_ATTEMPTS):
            seq = self._send(msg, msg_type, NLM_F_REQUEST | NLM_F_DUMP)
            answers = list(self._replies(seq, done_at_ack=False))
            if not any(flags & NLM_F_DUMP_INTR for flags, _ in answers):
                return [data for _, data in answers]
        raise NetlinkError(0, f"netlink dump (type {msg_type}) kept being interrupted by concurrent changes")

    # ------------------------------------------------------------ wire

    def _send(self, msg: Message, msg_type: int, flags: int) -> int:
        self._seq = self._seq % 0x7FFFFFFF + 1
        data = msg.encode(msg_type, flags, self._seq)
        try:
            self._sock.send(data)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise NetlinkError(errno.ETIMEDOUT, f"the kernel took no request within {TIMEOUT:g}s") from None
        return self._seq

    def _replies(
        self, seq: int, done_at_ack: bool, first_only: bool = False, small: bool = False
    ) -> Iterator[tuple[int, bytes]]:
        """``(flags, message bytes)`` of each data message answering ``seq``, until the answer is complete. Raises
        NetlinkError for an error answer. With ``first_only`` the answer is complete after its first data message
        (GET of one object: the kernel sends it without NLMSG_DONE). ``small``: the answer is an ACK or an error,
        which always fits the buffer (see :meth:`_recv`)."""
        while True:
            n = self._recv(small)
            for msg_type, flags, msg_seq, data in nlwire.messages(memoryview(self._buf)[:n]):
                if msg_seq != seq:
                    continue  # an answer to an earlier request given up on (cannot happen with one caller)
                if msg_type == NLMSG_ERROR:
                    code, text = error_of(flags, data)
                    if code:
                        raise NetlinkError(code, text)
                    if done_at_ack:
                        return
                    continue
                if msg_type == NLMSG_DONE:
                    code = _ERRNO.unpack_from(data, NLMSGHDR.size)[0] if len(data) >= NLMSGHDR.size + 4 else 0
                    if code < 0:
                        raise NetlinkError(-code, os.strerror(-code))
                    return
                if msg_type in (NLMSG_NOOP, NLMSG_OVERRUN):
                    continue
                yield flags, bytes(data)
                if first_only:
                    return

    def _recv(self, small: bool = False) -> int:
        # For data answers, peek at the real size first, as iproute2 does: a datagram larger than the buffer would
        # otherwise be cut silently (dumps come in datagrams of at most 32 KiB, but one GET answer, e.g. a link with
        # many VFs, can be bigger). An ACK or error answer (``small``) is read at once: it is the failed request's
        # header (NETLINK_CAP_ACK) or, on kernels without it, the request itself, and a few hundred bytes of the
        # kernel's message; every request here is far below the buffer's 64 KiB. MSG_TRUNC still reports a cut one.
        # (One system call less per request: each is a moment the agent's threads hand the GIL to one another.)
        try:
            if not small:
                size = self._sock.recv_into(self._buf, len(self._buf), socket.MSG_PEEK | socket.MSG_TRUNC)
                if size > len(self._buf):
                    self._buf = bytearray(size)
            size = self._sock.recv_into(self._buf, len(self._buf), socket.MSG_TRUNC)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise NetlinkError(errno.ETIMEDOUT, f"no answer from the kernel within {TIMEOUT:g}s") from None
        if size > len(self._buf):
            raise NetlinkError(errno.EMSGSIZE, f"an answer of {size} bytes, larger than the {len(self._buf)} expected")
        return size


def _decoded(reply: type[M], data: bytes) -> M:
    try:
        return reply.decode(data)
    except ValueError as e:
        raise NetlinkError(errno.EBADMSG, f"a malformed answer from the kernel: {e}") from None


def error_of(flags: int, data: memoryview | bytes) -> tuple[int, str]:
    """``(errno, text)`` of an NLMSG_ERROR message; errno 0 is an ACK. The text is the kernel's extended ACK message
    after the errno's name when there is one ("Invalid argument: Nexthop device is not up"), else the errno's name."""
    (error,) = _ERRNO.unpack_from(data, NLMSGHDR.size)
    code = -error
    if not code:
        return 0, ""
    text = os.strerror(code)
    if flags & NLM_F_ACK_TLVS:
        start = NLMSGHDR.size + 4  # our header, the errno, then the failed request's header (and body unless capped)
        orig_len = NLMSGHDR.unpack_from(data, start)[0] if len(data) >= start + NLMSGHDR.size else NLMSGHDR.size
        offset = start + (NLMSGHDR.size if flags & NLM_F_CAPPED else nlwire.align(orig_len))
        for kind, value_start, value_end in nlwire.attrs(data, offset):
            if kind == NLMSGERR_ATTR_MSG:
                message = bytes(data[value_start:value_end]).split(b"\0", 1)[0].decode(errors="replace")
                if message:
                    text = f"{text}: {message}"
                break
    return code, text
