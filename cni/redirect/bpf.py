"""The bpf() system call, for the few commands the redirect needs: create a map, update and read it, load a program,
attach it to a device's ingress (tcx, Linux 6.6+), list and detach what is attached there.

Every object is a file descriptor owned by a :class:`Fd`; the kernel frees a program or map when its last descriptor
is closed and no device holds it. Attachments through ``BPF_PROG_ATTACH`` belong to the device, not to this process:
they stay after the agent exits (or is killed) and go with the device.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine, 321)
_libc = ctypes.CDLL(None, use_errno=True)
_ATTR = 128  # bytes of union bpf_attr passed; the kernel checks that the rest of what it knows is zero

MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_LOAD, PROG_ATTACH, PROG_DETACH = 5, 8, 9
PROG_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 13, 15, 16

MAP_TYPE_HASH, MAP_TYPE_ARRAY, MAP_TYPE_PERCPU_ARRAY = 1, 2, 6
PROG_TYPE_SCHED_CLS = 3
TCX_INGRESS = 46
ANY = 0  # BPF_ANY: create or update

LOG_SIZE = 1 << 20


class BpfError(OSError):
    """A bpf() command the kernel refused; ``log`` carries the verifier's account for a program load."""

    def __init__(self, errno_: int, what: str, log: str = "") -> None:
        super().__init__(errno_, f"{what}: {os.strerror(errno_)}" + (f"\n{log}" if log else ""))
        self.log = log


def _call(cmd: int, attr: bytes, what: str) -> int:
    buf = ctypes.create_string_buffer(attr.ljust(_ATTR, b"\0"), _ATTR)
    r = int(_libc.syscall(_NR_BPF, cmd, buf, _ATTR))
    if r < 0:
        raise BpfError(ctypes.get_errno(), what)
    return r


class Fd:
    """A bpf object's file descriptor; closed by :meth:`close` or at exit of a ``with`` block."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Fd:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Map(Fd):
    def __init__(self, fd: int, key_size: int, value_size: int) -> None:
        super().__init__(fd)
        self.key_size, self.value_size = key_size, value_size

    @classmethod
    def create(cls, map_type: int, key_size: int, value_size: int, max_entries: int, name: str) -> Map:
        attr = struct.pack("<IIIIIII16s", map_type, key_size, value_size, max_entries, 0, 0, 0, name.encode()[:15])
        return cls(_call(MAP_CREATE, attr, f"create map {name}"), key_size, value_size)

    def _elem(self, cmd: int, key: bytes, value: ctypes.Array[ctypes.c_char] | None, flags: int, what: str) -> int:
        k = ctypes.create_string_buffer(key, len(key))
        vp = ctypes.addressof(value) if value is not None else 0
        return _call(cmd, struct.pack("<IIQQQ", self.fd, 0, ctypes.addressof(k), vp, flags), what)

    def update(self, key: bytes, value: bytes) -> None:
        self._elem(MAP_UPDATE_ELEM, key, ctypes.create_string_buffer(value, len(value)), ANY, "update map entry")

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False when it was not there."""
        try:
            self._elem(MAP_DELETE_ELEM, key, None, 0, "delete map entry")
        except BpfError as e:
            if e.errno == 2:  # ENOENT
                return False
            raise
        return True

    def lookup(self, key: bytes, value_size: int | None = None) -> bytes | None:
        """The value at ``key`` (``value_size`` bytes: a per-CPU map's value is one slot per possible CPU)."""
        v = ctypes.create_string_buffer(value_size or self.value_size)
        try:
            self._elem(MAP_LOOKUP_ELEM, key, v, 0, "look up map entry")
        except BpfError as e:
            if e.errno == 2:
                return None
            raise
        return v.raw

    def walk(self) -> list[bytes]:
        """Every key of the map, in the kernel's order."""
        out: list[bytes] = []
        nxt = ctypes.create_string_buffer(self.key_size)
        prev: ctypes.Array[ctypes.c_char] | None = None
        while True:
            kp = ctypes.addressof(prev) if prev is not None else 0
            try:
                _call(MAP_GET_NEXT_KEY, struct.pack("<IIQQ", self.fd, 0, kp, ctypes.addressof(nxt)), "walk map")
            except BpfError as e:
                if e.errno == 2:
                    return out
                raise
            out.append(nxt.raw)
            prev = ctypes.create_string_buffer(nxt.raw, self.key_size)


def load(insns: bytes, name: str, prog_type: int = PROG_TYPE_SCHED_CLS, attach_type: int = 0) -> Fd:
    """Load a GPL program (the kernel's conntrack and redirect functions are for GPL programs only); BpfError with
    the verifier's log when it refuses."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(LOG_SIZE)
    attr = struct.pack(
        "<IIQQIIQII16sII",
        prog_type, len(insns) // 8, ctypes.addressof(code), ctypes.addressof(lic), 1, LOG_SIZE,
        ctypes.addressof(log), 0, 0, name.encode()[:15], 0, attach_type,
    )  # fmt: skip
    try:
        return Fd(_call(PROG_LOAD, attr, f"load program {name}"))
    except BpfError as e:
        raise BpfError(e.errno or 0, f"load program {name}", log.value.decode(errors="replace")[-4000:]) from None


def _attach_attr(ifindex: int, prog_fd: int, attach_type: int) -> bytes:
    return struct.pack("<IIIIIIQ", ifindex, prog_fd, attach_type, 0, 0, 0, 0)


def attach(ifindex: int, prog: Fd, attach_type: int = TCX_INGRESS) -> None:
    """Attach ``prog`` to the device's ingress, behind whatever is there already."""
    _call(PROG_ATTACH, _attach_attr(ifindex, prog.fd, attach_type), f"attach to ifindex {ifindex}")


def detach(ifindex: int, prog: Fd, attach_type: int = TCX_INGRESS) -> None:
    _call(PROG_DETACH, _attach_attr(ifindex, prog.fd, attach_type), f"detach from ifindex {ifindex}")


def attached(ifindex: int, attach_type: int = TCX_INGRESS) -> list[int]:
    """The ids of the programs attached to the device's ingress, in order; [] for a device without any."""
    ids = (ctypes.c_uint32 * 64)()
    attr = struct.pack("<IIIIQII", ifindex, attach_type, 0, 0, ctypes.addressof(ids), 64, 0)
    buf = ctypes.create_string_buffer(attr.ljust(_ATTR, b"\0"), _ATTR)
    if int(_libc.syscall(_NR_BPF, PROG_QUERY, buf, _ATTR)) < 0:
        raise BpfError(ctypes.get_errno(), f"list the programs on ifindex {ifindex}")
    (count,) = struct.unpack_from("<I", buf.raw, 24)
    return list(ids[: min(count, 64)])


@dataclass(frozen=True)
class ProgInfo:
    id: int
    tag: bytes
    name: str


def prog_by_id(prog_id: int) -> Fd:
    return Fd(_call(PROG_GET_FD_BY_ID, struct.pack("<III", prog_id, 0, 0), f"open program {prog_id}"))


def prog_info(prog: Fd) -> ProgInfo:
    info = ctypes.create_string_buffer(256)
    _call(OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", prog.fd, 256, ctypes.addressof(info)), "read program info")
    _, pid, tag = struct.unpack_from("<II8s", info.raw, 0)
    (name,) = struct.unpack_from("<16s", info.raw, 64)
    return ProgInfo(pid, tag, name.split(b"\0", 1)[0].decode(errors="replace"))


def possible_cpus() -> int:
    """How many slots a per-CPU map's value has: the kernel's possible CPUs (``0-3`` or ``0,2-5``)."""
    with open("/sys/devices/system/cpu/possible") as f:
        text = f.read().strip()
    top = 0
    for part in text.split(","):
        top = max(top, int(part.rsplit("-", 1)[-1]) + 1)
    return top
