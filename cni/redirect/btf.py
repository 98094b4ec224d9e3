"""The kernel's own type information (BTF, ``/sys/kernel/btf/vmlinux``): the ids of the kernel functions a program
calls (kfuncs are called by BTF id) and the byte offset of a struct member the program reads (``nf_conn.status``
moves between kernel builds).

Only what those two questions need is decoded: the header, the type records' lengths (to walk them) and the names
of functions and structs. A malformed blob raises :class:`BtfError`; nothing here trusts a length it has not
checked against the blob's size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

VMLINUX = "/sys/kernel/btf/vmlinux"
MAGIC = 0xEB9F

KIND_INT, KIND_ARRAY, KIND_STRUCT, KIND_UNION, KIND_ENUM = 1, 3, 4, 5, 6
KIND_FUNC, KIND_FUNC_PROTO, KIND_VAR, KIND_DATASEC, KIND_DECL_TAG, KIND_ENUM64 = 12, 13, 14, 15, 17, 19
_FIXED = {KIND_INT: 4, KIND_ARRAY: 12, KIND_VAR: 4, KIND_DECL_TAG: 4}  # bytes after the 12-byte record
_PER_MEMBER = {KIND_STRUCT: 12, KIND_UNION: 12, KIND_ENUM: 8, KIND_FUNC_PROTO: 8, KIND_DATASEC: 12, KIND_ENUM64: 12}
_MAX_KIND = 19


class BtfError(ValueError):
    pass


@dataclass
class Btf:
    funcs: dict[str, int] = field(default_factory=dict)  # function name -> type id
    members: dict[str, dict[str, int]] = field(default_factory=dict)  # struct name -> member -> bit offset

    def func(self, name: str) -> int:
        try:
            return self.funcs[name]
        except KeyError:
            raise BtfError(f"the kernel has no function {name} (its BTF does not list it)") from None

    def offset(self, struct_name: str, member: str) -> int:
        """The byte offset of ``struct_name.member``."""
        bits = self.members.get(struct_name, {}).get(member)
        if bits is None or bits % 8:
            raise BtfError(f"the kernel's BTF has no byte-aligned member {member} in struct {struct_name}")
        return bits // 8


def _name(strings: bytes, off: int) -> str:
    if off >= len(strings):
        raise BtfError(f"name offset {off} past the string section ({len(strings)} bytes)")
    end = strings.find(b"\0", off)
    return strings[off : end if end >= 0 else len(strings)].decode(errors="replace")


def parse(blob: bytes, funcs: set[str], structs: set[str]) -> Btf:
    """The ids of ``funcs`` and the members of ``structs`` found in ``blob`` (names not found are left out)."""
    if len(blob) < 24:
        raise BtfError("BTF shorter than its header")
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", blob)
    if magic != MAGIC:
        raise BtfError(f"not BTF (magic {magic:#x})")
    types_at, strs_at = hdr_len + type_off, hdr_len + str_off
    if hdr_len < 24 or types_at + type_len > len(blob) or strs_at + str_len > len(blob):
        raise BtfError("BTF sections run past the blob")
    strings = blob[strs_at : strs_at + str_len]
    out = Btf()
    pos, end, tid = types_at, types_at + type_len, 0
    while pos < end:
        if pos + 12 > end:
            raise BtfError(f"type record at {pos} runs past the type section")
        name_off, info, _size = struct.unpack_from("<III", blob, pos)
        tid += 1
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        if kind == 0 or kind > _MAX_KIND:
            raise BtfError(f"type {tid} has unknown kind {kind}")
        body = pos + 12
        pos = body + _FIXED.get(kind, 0) + _PER_MEMBER.get(kind, 0) * vlen
        if pos > end:
            raise BtfError(f"type {tid} runs past the type section")
        if kind == KIND_FUNC and name_off:
            name = _name(strings, name_off)
            if name in funcs:
                out.funcs.setdefault(name, tid)
        elif kind == KIND_STRUCT and name_off:
            name = _name(strings, name_off)
            if name in structs and name not in out.members:
                members: dict[str, int] = {}
                for i in range(vlen):
                    m_name, _m_type, m_off = struct.unpack_from("<III", blob, body + 12 * i)
                    members[_name(strings, m_name)] = m_off & 0xFFFFFF if kflag else m_off
                out.members[name] = members
    return out


def vmlinux(funcs: set[str], structs: set[str], path: str = VMLINUX) -> Btf:
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        why = f"{e.strerror} (a kernel without CONFIG_DEBUG_INFO_BTF)"
        raise BtfError(f"cannot read the kernel's BTF {path}: {why}") from None
    return parse(blob, funcs, structs)
