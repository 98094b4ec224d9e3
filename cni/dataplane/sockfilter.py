"""Classic BPF socket filters for netlink multicast sockets: the kernel drops the events a listener does not want
before they wake it.

A listener in a multicast group (links, routes, neighbours) gets every event of the netns: each pod's ADD and DEL
sends several, and neighbour entries change all the time. Filtering in the kernel keeps the thread or event loop
asleep for all but the few it acts on. A program sees each event on its own (the kernel multicasts one message per
datagram) from its netlink header on. Classic BPF loads words in network byte order and netlink is in the host's,
hence the constants' bytes read big-endian (:func:`host_u16`, :func:`host_u32`).

Standard library only (the standalone entry point's DEL uses it).
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
from collections.abc import Sequence

SO_ATTACH_FILTER = 26
TYPE_OFFSET = 4  # nlmsghdr: length (u32), then the message type (u16)
BODY_OFFSET = 16  # after the nlmsghdr
_INSN = struct.Struct("=HBBI")  # struct sock_filter: code, jump if true, jump if false, k
LDH, LDW = 0x28, 0x20  # BPF_LD|BPF_H|BPF_ABS, BPF_LD|BPF_W|BPF_ABS: a 16- or 32-bit word at an offset
JEQ, RET = 0x15, 0x06  # BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
KEEP, DROP = (RET, 0, 0, 0xFFFFFFFF), (RET, 0, 0, 0)

Insn = tuple[int, int, int, int]


def host_u16(value: int) -> int:
    """``value`` as a 16-bit field in host order reads when loaded by BPF."""
    return int.from_bytes(struct.pack("=H", value), "big")


def host_u32(value: int, signed: bool = False) -> int:
    """``value`` as a 32-bit field in host order reads when loaded by BPF."""
    return int.from_bytes(struct.pack("=i" if signed else "=I", value), "big")


def types_only(types: Sequence[int]) -> list[Insn]:
    """A program keeping the messages of ``types`` (e.g. RTM_DELROUTE) and dropping the rest."""
    program: list[Insn] = [(LDH, 0, 0, TYPE_OFFSET)]
    for i, t in enumerate(types):
        to_keep = len(types) - i  # past the JEQs still ahead and DROP, to KEEP
        program.append((JEQ, to_keep, 0, host_u16(t)))
    return [*program, DROP, KEEP]


def attach(sock: socket.socket, program: Sequence[Insn]) -> bool:
    """Attach ``program`` to ``sock`` (before it joins a group, so that no event gets in unfiltered); False where the
    kernel refuses (the listener then gets everything and must check each event itself, as it does anyway)."""
    code = b"".join(_INSN.pack(*insn) for insn in program)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))  # struct sock_fprog: length, pointer
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        return True
    return False
