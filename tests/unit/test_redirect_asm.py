"""cni.redirect.asm: instructions encoded as the kernel reads them (checked against encodings written out by hand
from the instruction set's layout), and labels resolved to the right offsets whatever the program's shape."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cni.redirect.asm import R0, R1, R2, R6, R10, Asm, AsmError


def words(code: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("<BBhi", code[i : i + 8]) for i in range(0, len(code), 8)]


def test_instructions_are_encoded_as_the_kernel_reads_them() -> None:
    a = Asm()
    a.mov(R6, R1)  # BPF_ALU64 | BPF_MOV | BPF_X
    a.mov(R0, imm=-1)  # BPF_ALU64 | BPF_MOV | BPF_K, sign-extended
    a.alu("add", R2, imm=-184)
    a.ldx(4, R2, R6, 16)  # BPF_LDX | BPF_MEM | BPF_W
    a.stx(8, R10, -8, R2)  # BPF_STX | BPF_MEM | BPF_DW
    a.st(1, R10, -1, 0xFF)  # BPF_ST | BPF_MEM | BPF_B
    a.call(26)
    a.kfunc(65669)
    a.alu("mul", R1, imm=0x9E3779B1)  # BPF_ALU64 | BPF_MUL | BPF_K: the immediate as a signed 32-bit
    a.alu("xor", R1, src=R2)  # BPF_ALU64 | BPF_XOR | BPF_X
    a.exit()
    assert words(a.assemble()) == [
        (0xBF, 0x16, 0, 0), (0xB7, 0x00, 0, -1), (0x07, 0x02, 0, -184), (0x61, 0x62, 16, 0), (0x7B, 0x2A, -8, 0),
        (0x72, 0x0A, -1, 0xFF), (0x85, 0x00, 0, 26), (0x85, 0x20, 0, 65669), (0x27, 0x01, 0, 0x9E3779B1 - (1 << 32)),
        (0xAF, 0x21, 0, 0), (0x95, 0x00, 0, 0),
    ]  # fmt: skip


def test_a_map_load_takes_two_slots_naming_the_map_descriptor() -> None:
    a = Asm()
    a.load_map(R1, 7)
    a.exit()
    assert words(a.assemble()) == [(0x18, 0x11, 0, 7), (0x00, 0x00, 0, 0), (0x95, 0, 0, 0)]


def test_jumps_resolve_forward_and_back_and_32_bit_compares_use_their_class() -> None:
    a = Asm()
    a.label("top")
    a.jmp("jeq", "end", R2, imm=8)
    a.jmp("jne", "top", R2, src=R1, wide=False)
    a.jmp("ja", "top")
    a.label("end")
    a.exit()
    assert words(a.assemble())[:3] == [(0x15, 0x02, 2, 8), (0x5E, 0x12, -2, 0), (0x05, 0x00, -3, 0)]


def test_unknown_and_twice_defined_labels_are_refused() -> None:
    a = Asm()
    a.jmp("ja", "nowhere")
    with pytest.raises(AsmError, match="nowhere"):
        a.assemble()
    a.label("x")
    with pytest.raises(AsmError, match="twice"):
        a.label("x")


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=40))
def test_every_jump_lands_on_its_label(jumps: list[tuple[int, int]]) -> None:
    """Any layout of labels and jumps: each jump's offset, counted from the next instruction, reaches the label's
    instruction."""
    a = Asm()
    labels = sorted({t for _, t in jumps})
    sites: list[tuple[int, int]] = []
    at: dict[int, int] = {}  # label -> the index of the instruction written right after it
    emitted = 0
    for i in range(max(max(labels), max(s for s, _ in jumps)) + 1):
        if i in labels:
            a.label(f"L{i}")
            at[i] = emitted
        for site, target in jumps:
            if site == i:
                sites.append((emitted, target))
                a.jmp("ja", f"L{target}")
                emitted += 1
        a.mov(R0, imm=i)
        emitted += 1
    a.exit()
    code = words(a.assemble())
    assert len(code) == emitted + 1
    for index, target in sites:
        assert index + 1 + code[index][2] == at[target]
