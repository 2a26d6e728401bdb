"""A post-pass over a cubin's sm_90 SASS: the yield / reuse control bits of long FFMA runs.

Design note. DeepGEMM's "FFMA SASS interleaving" flips the *yield* hint on part of the FFMAs of
its FP32 promotion after compiling, so the warp scheduler may switch to the other math
warpgroup (and issue its WGMMAs) in the middle of a long FFMA sequence; it reported up to 10%+.
This module does the same to any kernel of a cubin, as an opt-in A/B switch
(``PTXTRAIN_JIT_FFMA_YIELD``, default ``"off"``): it finds the kernel's ``.text.<symbol>``
section with a small ELF64 reader (no external tools), decodes each 16-byte instruction's opcode
and control fields, groups the FFMAs into *runs* and rewrites one control bit per FFMA according
to a mode (:func:`patch_ffma_yield`).

On an H200, ptxas 13 already alternates yielding and non-yielding FFMAs in the PTX GEMM's
promotion, and every other pattern is slower (``interleave`` 0-3%, ``all`` 0-7%, ``none`` 3-13%,
over the six V3 shapes of 1D2D at M = 4096 and of wgrad), so the default stays ``"off"``.

Why it is safe: only FFMA instructions change, and in them only two things, both scheduling
hints: the yield bit (bit 45 of the high word) and the operand-reuse flags (bits 58-61), which
are only ever *cleared*, never set. Opcode, operands, predicate, stall counts and scoreboard
barriers (which carry every dependency) are untouched, so each instruction computes the same
thing with the same waits. A warp that yields may lose its operand-reuse cache, which is why an
FFMA made to yield has its reuse flags cleared (the compiler never sets reuse on a yielding
instruction either: in every kernel read so far, each ``.reuse`` instruction has the don't-yield
value); clearing reuse only sends operand reads back to the register file. Instructions that the
text section's relocations patch at load time are left alone.

Encoding (sm_90; opcode, registers, predicate and reuse checked against ``cuobjdump -sass`` /
``nvdisasm`` on the PTX GEMM's cubins, see tests/jit/test_sass.py): an instruction is 128 bits,
two little-endian 64-bit words ``lo``, ``hi``. The disassemblers print no other control bits;
their meaning is read from the compiled code: write scoreboards only on variable-latency
instructions (LDS, S2R, MUFU, ...), every waited scoreboard set before, dependent FP32
instructions at least 4 stall cycles apart, and the yield polarity from the reuse flags (never
on an instruction whose bit 45 is 0).

- ``lo[0:12]`` opcode: ``lo[0:9]`` the operation (``0x023`` FFMA, ``0x020`` FMUL, ``0x021``
  FADD), ``lo[9:12]`` the operand form (FFMA: 1 all registers; 2 / 3 / 7 an immediate /
  constant / uniform register as third source; 4 / 5 / 6 the same as second source).
- ``lo[12:16]`` guard predicate (``lo[12:15]`` its index, 7 = PT; ``lo[15]`` negated),
  ``lo[16:24]`` destination register (255 = RZ), ``lo[24:32]``
  and ``lo[32:40]`` the first two source registers; ``hi[0:8]`` FFMA's third source.
- ``hi[41:45]`` stall cycles, ``hi[45]`` yield (0 = may yield, 1 = don't yield), ``hi[46:49]``
  write scoreboard (7 = none), ``hi[49:52]`` read scoreboard (7 = none), ``hi[52:58]`` wait
  mask (one bit per scoreboard), ``hi[58:62]`` reuse flags (bit ``58 + i``: source ``i``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from dataclasses import dataclass

from ptxtrain.jit.cache import ELF_MAGIC, debug_log
from ptxtrain.jit.compiler import CompiledKernel

FFMA_YIELD_ENV = "PTXTRAIN_JIT_FFMA_YIELD"
FFMA_YIELD_MODES = ("off", "interleave", "all", "none")

INSTRUCTION_BYTES = 16
# A run: FFMAs in program order with at most MAX_RUN_GAP instructions other than FFMA / FMUL
# between consecutive ones. 8, not fewer: the 1D1D GEMM's promotion loads its scales (LDS.64 and
# their address math, 4-7 instructions) between FFMAs of one 64-FFMA promotion, while the
# WGMMA issue between two promotions takes 14 or more; with 8 each promotion is one run.
MAX_RUN_GAP = 8
# Runs shorter than this are left alone (e.g. the FFMAs of an integer division's reciprocal).
MIN_RUN_FFMAS = 16
# "interleave" adds yields in the first INTERLEAVE_HEAD[0] / INTERLEAVE_HEAD[1] of a run.
INTERLEAVE_HEAD = (9, 16)

FFMA, FMUL, FADD = 0x023, 0x020, 0x021
FP32_OPS = {FFMA: "FFMA", FMUL: "FMUL", FADD: "FADD"}
_OPERATION_MASK = 0x1FF
_NO_YIELD = 1 << 45  # in hi: set = the warp does not yield after this instruction
_REUSE = 0xF << 58  # in hi: one flag per source operand
_PATCHABLE = _NO_YIELD | _REUSE  # the only bits patch_ffma_yield changes

_SHT_REL, _SHT_RELA = 9, 4


@dataclass(frozen=True)
class Instruction:
    """One decoded sm_90 instruction (the fields this pass needs; layout in the module note).

    Attributes:
        lo, hi: the two 64-bit words.
        opcode: ``lo[0:12]``, operation (``opcode & 0x1ff``) and operand form (``opcode >> 9``).
        dst: destination register number ``lo[16:24]`` (255 = RZ; meaningful for ALU ops).
        stall: ``hi[41:45]``, cycles before the warp's next instruction may issue.
        yields: True when the yield bit ``hi[45]`` is 0 (the scheduler may switch warps).
        write_barrier, read_barrier: ``hi[46:49]``, ``hi[49:52]``; 7 = none.
        wait_mask: ``hi[52:58]``, scoreboards waited on before issue.
        reuse: ``hi[58:62]``, operand-reuse flags (bit i: source i).
    """

    lo: int
    hi: int
    opcode: int
    dst: int
    stall: int
    yields: bool
    write_barrier: int
    read_barrier: int
    wait_mask: int
    reuse: int

    @property
    def fp32_op(self) -> str | None:
        """``"FFMA"``, ``"FMUL"``, ``"FADD"`` (any operand form), or None for other opcodes."""
        return FP32_OPS.get(self.opcode & _OPERATION_MASK)

    @property
    def is_ffma(self) -> bool:
        return self.opcode & _OPERATION_MASK == FFMA


def decode(word: bytes) -> Instruction:
    """Decodes one 16-byte sm_90 instruction (two little-endian 64-bit words, low first).

    Raises:
        ValueError: ``word`` is not 16 bytes.
    """
    if len(word) != INSTRUCTION_BYTES:
        raise ValueError(f"word: expected {INSTRUCTION_BYTES} bytes, got {len(word)}")
    lo, hi = struct.unpack("<QQ", word)
    return Instruction(
        lo=lo,
        hi=hi,
        opcode=lo & 0xFFF,
        dst=(lo >> 16) & 0xFF,
        stall=(hi >> 41) & 0xF,
        yields=not hi & _NO_YIELD,
        write_barrier=(hi >> 46) & 0x7,
        read_barrier=(hi >> 49) & 0x7,
        wait_mask=(hi >> 52) & 0x3F,
        reuse=(hi >> 58) & 0xF,
    )


# ---- ELF64 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


def _sections(cubin: bytes) -> list[_Section]:
    """The section headers of an ELF64 little-endian file (``e_shnum`` / ``e_shstrndx`` escapes
    through section 0 handled). Raises ValueError naming ``cubin``."""
    if len(cubin) < 64 or cubin[:4] != ELF_MAGIC:
        raise ValueError("cubin: not an ELF file (no \\x7fELF magic)")
    if cubin[4] != 2 or cubin[5] != 1:
        raise ValueError(
            f"cubin: expected ELF64 little-endian (EI_CLASS 2, EI_DATA 1), got {cubin[4]}, "
            f"{cubin[5]}"
        )
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    if shoff == 0 or shentsize < 64:
        raise ValueError(f"cubin: no section header table (e_shoff {shoff}, size {shentsize})")

    def header(i: int) -> tuple:
        at = shoff + i * shentsize
        if at + 64 > len(cubin):
            raise ValueError(f"cubin: section header {i} lies past the end ({len(cubin)} B)")
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info,
        # sh_addralign, sh_entsize
        return struct.unpack_from("<IIQQQQIIQQ", cubin, at)

    first = header(0)
    if shnum == 0:  # SHN_UNDEF: the count is section 0's sh_size
        shnum = first[5]
    if shstrndx == 0xFFFF:  # SHN_XINDEX: the index is section 0's sh_link
        shstrndx = first[6]
    raw = [header(i) for i in range(shnum)]
    if not 0 < shstrndx < shnum:
        raise ValueError(f"cubin: section name table index {shstrndx} out of range ({shnum})")
    str_off, str_size = raw[shstrndx][4], raw[shstrndx][5]
    if str_off + str_size > len(cubin):
        raise ValueError("cubin: the section name table lies past the end of the file")
    names = cubin[str_off : str_off + str_size]
    sections = []
    for name_at, sh_type, _, _, offset, size, link, info, _, entsize in raw:
        end = names.find(b"\0", name_at)
        name = names[name_at : end if end >= 0 else len(names)].decode(errors="replace")
        sections.append(_Section(name, sh_type, offset, size, link, info, entsize))
    return sections


def kernel_text(cubin: bytes, symbol: str) -> tuple[int, int]:
    """``(offset, size)`` in bytes of the ``.text.<symbol>`` section (the kernel's SASS) in an
    ELF64 little-endian cubin; ``size`` is a multiple of 16 (one instruction per 16 bytes).

    Raises:
        ValueError: ``cubin`` is not an ELF64 little-endian file or is truncated; ``symbol`` has
            no text section (the message lists the kernels the cubin holds).
    """
    sections, index = _text_section(cubin, symbol)
    return sections[index].offset, sections[index].size


def _text_section(cubin: bytes, symbol: str) -> tuple[list[_Section], int]:
    """The cubin's sections and the index of ``.text.<symbol>`` (validated)."""
    if not isinstance(symbol, str) or not symbol:
        raise ValueError(f"symbol: expected a kernel's (lowered) name, got {symbol!r}")
    sections = _sections(cubin)
    want = f".text.{symbol}"
    for index, section in enumerate(sections):
        if section.name == want:
            if section.offset + section.size > len(cubin):
                raise ValueError(f"cubin: section {want} lies past the end of the file")
            if section.size % INSTRUCTION_BYTES:
                raise ValueError(
                    f"cubin: section {want} is {section.size} B, not whole 16-byte instructions"
                )
            return sections, index
    kernels = sorted(s.name[len(".text.") :] for s in sections if s.name.startswith(".text."))
    raise ValueError(f"symbol: no section {want!r} in the cubin; its kernels: {kernels}")


def _relocated(cubin: bytes, sections: list[_Section], text_index: int, text_size: int):
    """Indices of the instructions that relocations of the text section patch at load time."""
    touched = set()
    for section in sections:
        if section.type not in (_SHT_REL, _SHT_RELA) or section.info != text_index:
            continue
        entsize = section.entsize or (24 if section.type == _SHT_RELA else 16)
        for at in range(section.offset, section.offset + section.size, entsize):
            (r_offset,) = struct.unpack_from("<Q", cubin, at)
            if r_offset < text_size:
                touched.add(r_offset // INSTRUCTION_BYTES)
    return touched


# ---- runs and modes ------------------------------------------------------------------------------


def ffma_runs(instructions: list[Instruction]) -> list[list[int]]:
    """The FFMA runs of a kernel's instructions: lists of indices (into ``instructions``) of the
    FFMAs of each maximal sequence in which at most :data:`MAX_RUN_GAP` instructions other than
    FFMA / FMUL lie between consecutive FFMAs; runs of fewer than :data:`MIN_RUN_FFMAS` FFMAs
    are dropped. (In the PTX GEMM each run is one FP32 promotion of a 128-K block.)"""
    runs, current, gap = [], [], 0
    for i, ins in enumerate(instructions):
        if ins.is_ffma:
            if current and gap > MAX_RUN_GAP:
                runs.append(current)
                current = []
            current.append(i)
            gap = 0
        elif ins.opcode & _OPERATION_MASK != FMUL:
            gap += 1
    runs.append(current)
    return [run for run in runs if len(run) >= MIN_RUN_FFMAS]


def _set_yield(hi: int) -> int:
    """May yield, reuse flags cleared (a yielding warp cannot count on its reuse cache)."""
    return hi & ~_PATCHABLE


def _new_hi(mode: str, run: list[int], instructions: list[Instruction]) -> dict[int, int]:
    """index -> new high word for the FFMAs of one run under ``mode``."""
    if mode == "all":
        return {i: _set_yield(instructions[i].hi) for i in run}
    if mode == "none":
        return {i: instructions[i].hi | _NO_YIELD for i in run}
    num, den = INTERLEAVE_HEAD
    head = run[: (len(run) * num + den - 1) // den]
    staying = [i for i in head if not instructions[i].yields]
    return {i: _set_yield(instructions[i].hi) for i in staying[::2]}


def patch_ffma_yield(cubin: bytes, symbol: str, mode: str) -> tuple[bytes, int]:
    """Rewrites the yield / reuse control bits of the FFMAs in the long FFMA runs
    (:func:`ffma_runs`) of kernel ``symbol`` in ``cubin``.

    Modes:

    - ``"off"``: ``cubin`` unchanged.
    - ``"interleave"``: in each run of L FFMAs, among the first ⌈9L/16⌉ FFMAs, take those that
      do not yield, in program order; the 1st, 3rd, 5th, ... of them yield from now on, with
      their reuse flags cleared. ptxas already alternates don't-yield / yield over a promotion
      (one FFMA in two yields; the 1D2D kernel's non-yielding ones carry the reuse of the shared
      scale), so this makes about three in four yield in the run's first half, while the other
      math warpgroup's WGMMAs are being issued, and leaves the rest as compiled.
    - ``"all"``: every FFMA of every run yields, reuse flags cleared.
    - ``"none"``: no FFMA of any run yields (bit 45 set); reuse flags untouched.

    Only FFMA instructions change and only in bits 45 and 58-61 of their high word; every other
    byte of the cubin is kept. FFMAs that a relocation of the text section patches are skipped.

    Returns:
        (the patched cubin, the number of instructions changed).

    Raises:
        ValueError: a ``mode`` not in :data:`FFMA_YIELD_MODES`; a ``cubin`` that is not ELF64
            little-endian; a ``symbol`` without a text section (see :func:`kernel_text`).
        TypeError: ``cubin`` is not bytes-like.
    """
    if mode not in FFMA_YIELD_MODES:
        raise ValueError(f"mode: expected one of {FFMA_YIELD_MODES}, got {mode!r}")
    if not isinstance(cubin, bytes | bytearray | memoryview):
        raise TypeError(f"cubin: expected bytes, got {type(cubin).__name__}")
    cubin = bytes(cubin)
    sections, text_index = _text_section(cubin, symbol)
    if mode == "off":
        return cubin, 0
    text = sections[text_index]
    instructions = [
        decode(cubin[at : at + INSTRUCTION_BYTES])
        for at in range(text.offset, text.offset + text.size, INSTRUCTION_BYTES)
    ]
    skip = _relocated(cubin, sections, text_index, text.size)
    out = bytearray(cubin)
    changed = 0
    for run in ffma_runs(instructions):
        for i, hi in _new_hi(mode, run, instructions).items():
            old = instructions[i].hi
            assert (hi ^ old) & ~_PATCHABLE == 0, "patch_ffma_yield changed a non-control bit"
            if hi == old or i in skip:
                continue
            struct.pack_into("<Q", out, text.offset + i * INSTRUCTION_BYTES + 8, hi)
            changed += 1
    return bytes(out), changed


def default_ffma_yield_mode() -> str:
    """The mode named by ``PTXTRAIN_JIT_FFMA_YIELD`` (read at each call; default ``"off"``).

    Raises:
        ValueError: the variable holds another value (the message names it and the allowed
            values).
    """
    value = os.environ.get(FFMA_YIELD_ENV, "").strip().lower() or "off"
    if value not in FFMA_YIELD_MODES:
        raise ValueError(
            f"{FFMA_YIELD_ENV}={os.environ[FFMA_YIELD_ENV]!r}: expected one of {FFMA_YIELD_MODES}"
        )
    return value


def with_ffma_yield(
    compiled: CompiledKernel, mode: str, expression: str | None = None
) -> CompiledKernel:
    """``compiled`` with :func:`patch_ffma_yield` applied to the kernel named by ``expression``
    (default: the first name expression). ``"off"`` returns ``compiled`` itself; any other mode a
    copy whose ``key`` ends in ``":ffma_yield=<mode>"``, so ``load_kernel``'s module cache (keyed
    on ``key``) never hands out the unpatched module for it or the other way round.

    Raises:
        ValueError: as :func:`patch_ffma_yield`, or an unknown ``expression``.
    """
    if mode not in FFMA_YIELD_MODES:
        raise ValueError(f"mode: expected one of {FFMA_YIELD_MODES}, got {mode!r}")
    if mode == "off":
        return compiled
    cubin, changed = patch_ffma_yield(compiled.cubin, compiled.symbol(expression), mode)
    debug_log(f"ffma yield {mode}: {changed} FFMAs of {compiled.name} changed")
    base = compiled.key or hashlib.sha256(compiled.cubin).hexdigest()
    return dataclasses.replace(compiled, cubin=cubin, key=f"{base}:ffma_yield={mode}")


__all__ = [
    "FFMA_YIELD_ENV",
    "FFMA_YIELD_MODES",
    "INTERLEAVE_HEAD",
    "MAX_RUN_GAP",
    "MIN_RUN_FFMAS",
    "Instruction",
    "decode",
    "default_ffma_yield_mode",
    "ffma_runs",
    "kernel_text",
    "patch_ffma_yield",
    "with_ffma_yield",
]
