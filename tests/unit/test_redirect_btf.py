"""cni.redirect.btf: function ids and member offsets read from BTF laid out as the kernel lays it out (built here
record by record), and any blob, however malformed, either read or refused with BtfError."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cni.redirect.btf import BtfError, parse

INT, STRUCT, ENUM, FUNC_PROTO, FUNC = 1, 4, 6, 13, 12


class Blob:
    def __init__(self) -> None:
        self.types = b""
        self.strings = b"\0"

    def name(self, text: str) -> int:
        off = len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, name: str, kind: int, vlen: int, size: int, tail: bytes, kflag: bool = False) -> None:
        info = kind << 24 | vlen | (1 << 31 if kflag else 0)
        self.types += struct.pack("<III", self.name(name) if name else 0, info, size) + tail

    def bytes(self) -> bytes:
        header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strings))
        return header + self.types + self.strings


def sample() -> bytes:
    b = Blob()
    b.add("int", INT, 0, 4, struct.pack("<I", 32))  # 1
    b.add("nf_conn", STRUCT, 2, 16, struct.pack("<III", b.name("ct_general"), 1, 0)
          + struct.pack("<III", b.name("status"), 1, 64))  # 2  # fmt: skip
    b.add("bits", STRUCT, 1, 8, struct.pack("<III", b.name("f"), 1, 3 << 24 | 40), kflag=True)  # 3
    b.add("", FUNC_PROTO, 1, 1, struct.pack("<II", 0, 1))  # 4
    b.add("colour", ENUM, 2, 4, struct.pack("<Ii", b.name("RED"), 0) + struct.pack("<Ii", b.name("BLUE"), 1))  # 5
    b.add("bpf_skb_ct_lookup", FUNC, 0, 4, b"")  # 6
    b.add("bpf_ct_release", FUNC, 0, 4, b"")  # 7
    return b.bytes()


def test_function_ids_and_member_offsets_are_found_past_records_of_every_shape() -> None:
    got = parse(sample(), {"bpf_skb_ct_lookup", "bpf_ct_release", "absent"}, {"nf_conn", "bits"})
    assert got.func("bpf_skb_ct_lookup") == 6 and got.func("bpf_ct_release") == 7
    assert got.offset("nf_conn", "status") == 8
    assert got.offset("bits", "f") == 5  # a bitfield struct's member offset: the low 24 bits
    with pytest.raises(BtfError, match="absent"):
        got.func("absent")
    with pytest.raises(BtfError, match="colour"):
        got.offset("colour", "RED")


def test_a_blob_that_is_not_btf_or_runs_past_itself_is_refused() -> None:
    good = sample()
    with pytest.raises(BtfError, match="magic"):
        parse(b"\0" * 24 + good[24:], set(), set())
    with pytest.raises(BtfError):
        parse(good[:40], set(), set())
    with pytest.raises(BtfError, match="header"):
        parse(good[:10], set(), set())


@given(st.binary(max_size=300), st.booleans())
def test_any_bytes_are_read_or_refused_with_btf_error(data: bytes, with_header: bool) -> None:
    """Random bytes, or random type records behind a header that claims them: read, or refused with BtfError."""
    if with_header:
        data = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(data), len(data), 0) + data
    try:
        got = parse(data, {"bpf_skb_ct_lookup"}, {"nf_conn"})
    except BtfError:
        return
    assert set(got.funcs) <= {"bpf_skb_ct_lookup"} and set(got.members) <= {"nf_conn"}


@given(st.integers(0, 400), st.integers(0, 255))
def test_a_corrupted_byte_anywhere_is_read_or_refused_with_btf_error(at: int, value: int) -> None:
    blob = bytearray(sample())
    blob[at % len(blob)] = value
    try:
        got = parse(bytes(blob), {"bpf_skb_ct_lookup"}, {"nf_conn"})
    except BtfError:
        return
    assert all(isinstance(v, int) for v in got.funcs.values())
