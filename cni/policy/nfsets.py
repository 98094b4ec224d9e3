"""Elements added to and read from nftables sets over nfnetlink, as ``nft add element`` and ``nft list set`` do it,
without running ``nft``.

The standalone CNI entry point quarantines every address it hands out (:mod:`cni.policy.quarantine`): running
``nft -f`` for that cost an exec of nft and the import of ``subprocess`` and the agent's command runner, about 15 ms
of a standalone ADD and of every standalone DEL. One netlink batch does the same in well under a millisecond:

    NFNL_MSG_BATCH_BEGIN                       (nfgenmsg: res_id NFNL_SUBSYS_NFTABLES)
    NFT_MSG_NEWSETELEM   table, set, elements  (one per set; NLM_F_CREATE, NLM_F_ACK: existing elements are kept)
    NFNL_MSG_BATCH_END

The kernel applies the batch as one transaction: every message of it or none. It answers each message that asks
for an ACK (and each that fails) once the batch is done; any error means nothing was added, and :class:`NfError`
carries the first one's errno and the kernel's extended message. A refused batch costs its abort (an RCU grace
period, 4-16 ms seen), so the table is looked up first (NFT_MSG_GETTABLE, no transaction), as ``nft`` does before
it sends anything: on a node without the table, which is the common answer, that is all there is to it. Numbers
from the kernel's ``linux/netfilter/nfnetlink.h`` and ``nf_tables.h``.

Reading a set (:func:`elements`, for the redirect, which looks at the quarantine's sets at every sync) is one dump,
NFT_MSG_GETSETELEM with the table and set names, answered by NFT_MSG_NEWSETELEM messages carrying the elements as
``add`` sends them, then NLMSG_DONE.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence

from cni.dataplane import nlwire
from cni.dataplane.nlwire import (
    NLA_F_NESTED,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSGHDR,
    attr,
    attrs,
)
from cni.dataplane.rtnl import error_of

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 16
NFNL_MSG_BATCH_END = 17
NFT_MSG_GETTABLE = 1
NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFTA_TABLE_NAME = 1
NFPROTO_INET = 1
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY = 1
NFTA_DATA_VALUE = 1

_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version (NFNETLINK_V0), res_id (big endian)


class NfError(Exception):
    """The kernel refused the batch (nothing of it applied), or did not answer in time."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(code, text)
        self.code = code
        self.text = text

    def __str__(self) -> str:
        return self.text


def _message(msg_type: int, flags: int, seq: int, family: int, res_id: int, body: bytes) -> bytes:
    payload = _NFGEN.pack(family, 0, res_id) + body
    return nlwire.message(msg_type, flags, seq, payload)


def batch(family: int, table: str, sets: Mapping[str, Sequence[bytes]], seq: int = 1) -> tuple[bytes, list[int]]:
    """The batch adding ``sets`` (set name -> element keys as bytes) to ``table``, and the sequence numbers of the
    messages that will be answered."""
    subsys = socket.htons(NFNL_SUBSYS_NFTABLES)
    out = [_message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, socket.AF_UNSPEC, subsys, b"")]
    answered = []
    for name, keys in sets.items():
        if not keys:
            continue
        elements = b"".join(
            attr(NFTA_LIST_ELEM | NLA_F_NESTED, attr(NFTA_SET_ELEM_KEY | NLA_F_NESTED, attr(NFTA_DATA_VALUE, key)))
            for key in dict.fromkeys(keys)
        )
        body = (
            attr(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0")
            + attr(NFTA_SET_ELEM_LIST_SET, name.encode() + b"\0")
            + attr(NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED, elements)
        )
        seq += 1
        msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM
        out.append(_message(msg_type, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, seq, family, 0, body))
        answered.append(seq)
    out.append(_message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq + 1, socket.AF_UNSPEC, subsys, b""))
    return b"".join(out), answered


def get_table(family: int, table: str, seq: int) -> bytes:
    """The request for ``table`` (answered by the table, or an error: ENOENT when there is none)."""
    body = attr(NFTA_TABLE_NAME, table.encode() + b"\0")
    return _message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, NLM_F_REQUEST | NLM_F_ACK, seq, family, 0, body)


def add_elements(table: str, sets: Mapping[str, Sequence[bytes]], timeout: float, family: int = NFPROTO_INET) -> None:
    """Add the elements of ``sets`` to the sets of ``table`` in one transaction; :class:`NfError` when the kernel
    refuses (ENOENT: no such table or set) or does not answer within ``timeout`` seconds (ETIMEDOUT)."""
    data, answered = batch(family, table, sets, seq=2)
    if not answered:
        return
    with _session(timeout) as sock:
        _exchange(sock, get_table(family, table, 1), {1}, 0)
        _exchange(sock, data, set(answered), answered[0] - 1)


@contextlib.contextmanager
def _session(timeout: float) -> Iterator[socket.socket]:
    """An nfnetlink socket whose every call ends after ``timeout`` seconds; a socket error in the block, or the
    kernel's silence, as :class:`NfError`."""
    try:
        sock = nlwire.open_socket(NETLINK_NETFILTER, timeout)
    except OSError as e:
        raise NfError(e.errno or errno.EPROTONOSUPPORT, f"open an nfnetlink socket: {e.strerror or e}") from None
    with sock:
        try:
            yield sock
        except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO or SO_SNDTIMEO ran out
            raise NfError(errno.ETIMEDOUT, f"no answer from the kernel within {timeout:g}s") from None
        except OSError as e:
            raise NfError(e.errno or errno.EIO, e.strerror or str(e)) from None


def get_elements(family: int, table: str, name: str, seq: int) -> bytes:
    """The dump request for the elements of set ``name`` of ``table`` (answered by NFT_MSG_NEWSETELEM messages, then
    NLMSG_DONE; or an error: ENOENT when there is no such table or set)."""
    body = attr(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0") + attr(NFTA_SET_ELEM_LIST_SET, name.encode() + b"\0")
    msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM
    return _message(msg_type, NLM_F_REQUEST | NLM_F_DUMP, seq, family, 0, body)


def keys_of(msg: bytes | memoryview) -> list[bytes]:
    """The keys of the elements one message of such a dump carries (NFTA_SET_ELEM_LIST_ELEMENTS, each
    NFTA_LIST_ELEM's NFTA_SET_ELEM_KEY's NFTA_DATA_VALUE); whatever does not parse is left out."""
    view = memoryview(msg)
    out: list[bytes] = []

    def nested(start: int, end: int, kind: int) -> list[tuple[int, int]]:
        return [(a, b) for k, a, b in attrs(view[:end], start) if k == kind]

    for start, end in nested(NLMSGHDR.size + _NFGEN.size, len(view), NFTA_SET_ELEM_LIST_ELEMENTS):
        for e_start, e_end in nested(start, end, NFTA_LIST_ELEM):
            for k_start, k_end in nested(e_start, e_end, NFTA_SET_ELEM_KEY):
                out += [bytes(view[a:b]) for a, b in nested(k_start, k_end, NFTA_DATA_VALUE)]
    return out


def elements(table: str, name: str, timeout: float, family: int = NFPROTO_INET) -> list[bytes]:
    """The keys of every element of set ``name`` of ``table``, as ``nft list set`` reads them (a dump the kernel
    began again when the set changed under it is read again); :class:`NfError` when the kernel refuses (ENOENT:
    no such table or set) or does not answer within ``timeout`` seconds (ETIMEDOUT)."""
    with _session(timeout) as sock:
        for seq in range(1, 4):
            keys, whole = _dump(sock, get_elements(family, table, name, seq), seq)
            if whole:
                return keys
    raise NfError(errno.EAGAIN, f"set {name} of {table} changed under every one of 3 reads")


def _dump(sock: socket.socket, request: bytes, seq: int) -> tuple[list[bytes], bool]:
    """Send a dump request and read its answer to NLMSG_DONE: the keys, and whether the dump was consistent."""
    sock.sendall(request)
    keys: list[bytes] = []
    whole = True
    while True:
        for msg_type, flags, got, msg in nlwire.messages(sock.recv(1 << 16)):
            if got != seq:
                continue
            if msg_type == NLMSG_ERROR:
                code, text = error_of(flags, msg)
                if code:
                    raise NfError(code, text)
                continue
            whole = whole and not flags & NLM_F_DUMP_INTR
            if msg_type == NLMSG_DONE:
                return keys, whole
            keys += keys_of(msg)


def _exchange(sock: socket.socket, data: bytes, pending: set[int], begin: int) -> None:
    """Send ``data`` and read until each of ``pending`` is answered (or ``begin``, the batch, is refused); raises
    the first error answer as :class:`NfError`."""
    failure = None
    sock.sendall(data)
    while pending:
        for msg_type, flags, seq, msg in nlwire.messages(sock.recv(1 << 16)):
            if msg_type != NLMSG_ERROR or not (seq in pending or (begin and seq == begin)):
                continue  # the table itself, answering the lookup: its ACK follows
            code, text = error_of(flags, msg)
            if code and failure is None:
                failure = NfError(code, text)
            if seq == begin:  # the batch itself was refused (e.g. no nf_tables): nothing else comes
                pending.clear()
            pending.discard(seq)
    if failure is not None:
        raise failure
