"""eBPF instructions and a small assembler with labels (the program is a few dozen instructions: no compiler).

An instruction is 8 bytes: opcode, destination and source register (4 bits each), a signed 16-bit offset and a
signed 32-bit immediate; a 64-bit load of a map takes two. :class:`Asm` collects instructions whose jump offsets
may name a label, and :meth:`Asm.assemble` resolves them (offsets count instructions after the jump).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)

# operation | source (K: the immediate, X: a register) | class
_ALU64, _JMP, _JMP32, _LDX, _STX, _ST, _LD = 0x07, 0x05, 0x06, 0x01, 0x03, 0x02, 0x00
_K, _X = 0x00, 0x08
_ALU_OPS = {"add": 0x00, "sub": 0x10, "mul": 0x20, "or": 0x40, "and": 0x50, "lsh": 0x60, "rsh": 0x70, "xor": 0xA0,
            "mov": 0xB0}  # fmt: skip
_JMP_OPS = {"ja": 0x00, "jeq": 0x10, "jgt": 0x20, "jge": 0x30, "jset": 0x40, "jne": 0x50, "jlt": 0xA0, "jle": 0xB0}
_SIZES = {1: 0x10, 2: 0x08, 4: 0x00, 8: 0x18}
_MEM = 0x60
CALL, EXIT = 0x85, 0x95
PSEUDO_MAP_FD, PSEUDO_KFUNC_CALL = 1, 2


class AsmError(ValueError):
    pass


@dataclass
class _Insn:
    op: int
    dst: int = 0
    src: int = 0
    off: int | str = 0
    imm: int = 0


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


class Asm:
    def __init__(self) -> None:
        self.insns: list[_Insn] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        if name in self.labels:
            raise AsmError(f"label {name} defined twice")
        self.labels[name] = len(self.insns)

    def alu(self, op: str, dst: int, src: int | None = None, imm: int = 0) -> None:
        """64-bit ``dst op= src`` (a register) or ``dst op= imm``."""
        code = _ALU_OPS[op] | _ALU64
        self.insns.append(_Insn(code | _X, dst, src) if src is not None else _Insn(code | _K, dst, 0, 0, _s32(imm)))

    def mov(self, dst: int, src: int | None = None, imm: int = 0) -> None:
        self.alu("mov", dst, src, imm)

    def jmp(self, op: str, target: str, dst: int = 0, src: int | None = None, imm: int = 0, wide: bool = True) -> None:
        """``if dst op src|imm goto target`` (``ja``: always); ``wide=False`` compares the low 32 bits."""
        cls = _JMP if wide else _JMP32
        code = _JMP_OPS[op] | cls
        if src is not None:
            self.insns.append(_Insn(code | _X, dst, src, target))
        else:
            self.insns.append(_Insn(code | _K, dst, 0, target, _s32(imm)))

    def ldx(self, size: int, dst: int, src: int, off: int) -> None:
        """``dst = *(uN *)(src + off)``."""
        self.insns.append(_Insn(_LDX | _MEM | _SIZES[size], dst, src, off))

    def stx(self, size: int, dst: int, off: int, src: int) -> None:
        """``*(uN *)(dst + off) = src``."""
        self.insns.append(_Insn(_STX | _MEM | _SIZES[size], dst, src, off))

    def st(self, size: int, dst: int, off: int, imm: int) -> None:
        """``*(uN *)(dst + off) = imm``."""
        self.insns.append(_Insn(_ST | _MEM | _SIZES[size], dst, 0, off, _s32(imm)))

    def load_map(self, dst: int, map_fd: int) -> None:
        """``dst = &map`` (the two-slot 64-bit load the kernel rewrites to the map's address)."""
        self.insns.append(_Insn(_LD | 0x18, dst, PSEUDO_MAP_FD, 0, map_fd))
        self.insns.append(_Insn(0))

    def call(self, helper: int) -> None:
        self.insns.append(_Insn(CALL, 0, 0, 0, helper))

    def kfunc(self, btf_id: int) -> None:
        """Call a kernel function by its BTF id (in vmlinux)."""
        self.insns.append(_Insn(CALL, 0, PSEUDO_KFUNC_CALL, 0, btf_id))

    def exit(self) -> None:
        self.insns.append(_Insn(EXIT))

    def assemble(self) -> bytes:
        out = bytearray()
        for i, ins in enumerate(self.insns):
            off = ins.off
            if isinstance(off, str):
                if off not in self.labels:
                    raise AsmError(f"jump to undefined label {off}")
                off = self.labels[off] - i - 1
            if not -(1 << 15) <= off < 1 << 15:
                raise AsmError(f"offset {off} of instruction {i} out of range")
            out += struct.pack("<BBhi", ins.op, (ins.dst & 0xF) | (ins.src & 0xF) << 4, off, ins.imm)
        return bytes(out)
