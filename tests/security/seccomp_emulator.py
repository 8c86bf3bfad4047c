"""Run a seccomp program on a made-up ``struct seccomp_data``, in Python.

The red-team attempts run the real filter on this machine's architecture;
this emulator lets a test ask what the filter built for *another* one
(aarch64) answers, and which calls read their arguments at all (those the
kernel cannot cache as always allowed).
"""

from __future__ import annotations

import struct

import attrs

from sandbox import seccomp

_LD_W_ABS = 0x20
_JMP_JA = 0x05
_JMP_JEQ_K = 0x15
_JMP_JGE_K = 0x35
_JMP_JSET_K = 0x45
_ALU_AND_K = 0x54
_RET_K = 0x06


@attrs.frozen
class Verdict:
    """What the filter answered, and whether it looked at an argument to decide."""

    action: int
    read_arguments: bool

    @property
    def allowed(self) -> bool:
        return self.action == seccomp.RET_ALLOW

    @property
    def errno(self) -> int | None:
        if self.action & 0xFFFF0000 == seccomp.RET_ERRNO:
            return self.action & 0xFFFF
        return None

    @property
    def killed(self) -> bool:
        return self.action == seccomp.RET_KILL_PROCESS


def run(program: bytes, *, arch: int, nr: int, args: tuple[int, ...] = ()) -> Verdict:
    """Execute ``program`` for system call ``nr`` with ``args`` (little-endian, 64-bit)."""
    words = list(args) + [0] * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(w & 0xFFFFFFFFFFFFFFFF for w in words))
    code = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc = 0
    pc = 0
    read_arguments = False
    while True:
        op, jt, jf, k = code[pc]
        pc += 1
        if op == _LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
            read_arguments |= k >= 16
        elif op == _ALU_AND_K:
            acc &= k
        elif op == _JMP_JA:
            pc += k
        elif op == _JMP_JEQ_K:
            pc += jt if acc == k else jf
        elif op == _JMP_JGE_K:
            pc += jt if acc >= k else jf
        elif op == _JMP_JSET_K:
            pc += jt if acc & k else jf
        elif op == _RET_K:
            return Verdict(k, read_arguments)
        else:
            raise AssertionError(f"unknown BPF instruction {op:#x} at {pc - 1}")
