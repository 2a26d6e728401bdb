"""Tests of ptxtrain.jit.sass (the FFMA yield post-pass), on the CPU: the ELF reader and the decoder
against ``cuobjdump -sass`` of the PTX GEMM's real V3 kernels (and a kernel of every FP32 operand
form), and each mode's patch: the same disassembly but for ``.reuse``, bytes changed only in the
control bits of FFMAs, the predicted yield bits; errors; the load-cache key of a patched kernel."""

from __future__ import annotations

import dataclasses
import re
import struct
import subprocess

import pytest
import torch

from ptxtrain.gemm import ptx
from ptxtrain.jit import CompiledKernel, compile_cuda, nvrtc_available, sass
from ptxtrain.jit.cache import find_cuobjdump

pytestmark = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-bindings) missing")
needs_disassembler = pytest.mark.skipif(
    find_cuobjdump() is None, reason="no cuobjdump (PATH or the Triton wheel) here"
)

# The V3 kernels of the brief: wgrad (1D1D, D += fp32) and Fprop at K = 16384 (1D2D, bf16).
GEMMS = {
    "1d1d": ("1d1d", (7168, 4096, 4096), torch.float32, True),
    "1d2d": ("1d2d", (4096, 7168, 16384), torch.bfloat16, False),
}
PATCH_MODES = ("interleave", "all", "none")
_NO_YIELD = 1 << 45
_REUSE = 0xF << 58

# Every operand form of FFMA / FMUL / FADD (register, immediate, uniform register).
FORMS_SOURCE = r"""
extern "C" __global__ void fp32_forms(float* x, float a, float b) {
  const int i = threadIdx.x;
  const float v = x[i], w = x[i + 128], u = x[i + 256];
  x[i] = __fmaf_rn(v, w, u);
  x[i + 128] = __fmaf_rn(v, 3.5f, u);
  x[i + 256] = __fmaf_rn(v, w, 1.25f);
  x[i + 384] = __fmaf_rn(v, a, u);
  x[i + 512] = __fmaf_rn(v, w, b);
  x[i + 640] = __fmul_rn(v, w);
  x[i + 768] = __fmul_rn(v, 2.5f);
  x[i + 896] = __fmul_rn(v, a);
  x[i + 1024] = __fadd_rn(v, w);
  x[i + 1152] = __fadd_rn(v, 0.75f);
  x[i + 1280] = __fadd_rn(v, b);
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict[str, tuple[bytes, str]]:
    """name -> (cubin, kernel symbol) of GEMMS and of the operand-forms kernel."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path_factory.mktemp("jit")))
        for name, (kind, (m, n, k), out_dtype, accumulate) in GEMMS.items():
            cfg = ptx.select_config(kind, m, n, k, 132)
            cfg = ptx._resolve(cfg, kind, n, True, out_dtype)
            compiled, expr = ptx.compile_gemm(kind, cfg, n, k, out_dtype, accumulate)
            out[name] = (compiled.cubin, compiled.symbol(expr))
        forms = compile_cuda(FORMS_SOURCE, name="fp32_forms")
        out["forms"] = (forms.cubin, forms.symbol())
    return out


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_HIGH = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


def _listing(cubin: bytes, symbol: str, tmp_path) -> list[tuple[int, str, int, int]]:
    """(address, text, lo, hi) of every instruction of ``symbol`` in ``cuobjdump -sass``."""
    path = tmp_path / f"k{abs(hash(cubin))}.cubin"
    path.write_bytes(cubin)
    res = subprocess.run(
        [find_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    out, current = [], None
    for i, line in enumerate(lines):
        if "Function :" in line:
            current = line.split("Function :", 1)[1].strip()
            continue
        m = _INSTR.search(line)
        if m and current == symbol:
            high = _HIGH.match(lines[i + 1])
            assert high, f"no high word after {line!r}"
            out.append((int(m[1], 16), m[2], int(m[3], 16), int(high[1], 16)))
    assert out, f"{symbol} not in the listing"
    return out


def _mnemonic(text: str) -> tuple[str, list[str]]:
    """``"@!P0 FFMA R1, R2.reuse, R3, R4"`` -> ("FFMA", ["R1", "R2.reuse", "R3", "R4"])."""
    words = text.split(None, 1)
    if words[0].startswith("@"):
        words = words[1].split(None, 1)
    operands = [o.strip() for o in words[1].split(",")] if len(words) > 1 else []
    return words[0], operands


def _instructions(cubin: bytes, symbol: str) -> list[sass.Instruction]:
    offset, size = sass.kernel_text(cubin, symbol)
    return [sass.decode(cubin[a : a + 16]) for a in range(offset, offset + size, 16)]


@needs_disassembler
@pytest.mark.parametrize("name", [*GEMMS, "forms"])
def test_kernel_text_is_the_disassembled_code(kernels, name, tmp_path):
    cubin, symbol = kernels[name]
    offset, size = sass.kernel_text(cubin, symbol)
    listing = _listing(cubin, symbol, tmp_path)
    assert size == 16 * len(listing), f"{name}: {size} B for {len(listing)} instructions"
    for addr, text, lo, hi in listing:
        words = struct.unpack_from("<QQ", cubin, offset + addr)
        assert words == (lo, hi), f"{name} {addr:#x} {text}: {words} in the cubin"


@needs_disassembler
@pytest.mark.parametrize("name", [*GEMMS, "forms"])
def test_decoder_agrees_with_the_disassembler(kernels, name, tmp_path):
    cubin, symbol = kernels[name]
    listing = _listing(cubin, symbol, tmp_path)
    decoded = _instructions(cubin, symbol)
    counts = dict.fromkeys(sass.FP32_OPS.values(), 0)
    for (addr, text, _, _), ins in zip(listing, decoded, strict=True):
        where = f"{name} {addr:#x} {text}"
        op, operands = _mnemonic(text)
        base = op.split(".")[0]
        assert ins.fp32_op == (base if base in counts else None), where
        assert bool(ins.reuse) == (".reuse" in text), where
        # A warp that may yield cannot count on its reuse cache: ptxas never sets both.
        assert not (ins.reuse and ins.yields), where
        if ins.fp32_op is not None:
            counts[base] += 1
            dst = operands[0]
            assert ins.dst == (255 if dst == "RZ" else int(dst.removeprefix("R"))), where
            flagged = {i for i, o in enumerate(operands[1:]) if o.endswith(".reuse")}
            assert {i for i in range(4) if ins.reuse >> i & 1} == flagged, where
    assert counts["FFMA"] and counts["FMUL"], f"{name}: {counts}"
    if name == "forms":  # every operand form of the three ops was met
        forms = {(i.fp32_op, i.opcode >> 9) for i in decoded if i.fp32_op}
        assert {("FFMA", f) for f in (1, 2, 4, 6, 7)} <= forms, forms
        assert {("FMUL", f) for f in (1, 4, 6)} <= forms, forms
        assert {("FADD", f) for f in (1, 2, 7)} <= forms, forms


@pytest.mark.parametrize("name", GEMMS)
def test_control_fields_are_consistent(kernels, name):
    # The fields no disassembler prints, checked by what correct code must satisfy: FP32 ops
    # (fixed latency) set no scoreboard; every scoreboard waited on is set somewhere; an FP32
    # result is read at least 4 stall cycles (the FMA pipe's latency) after it was issued, and
    # in the 1D1D promotion (FMUL of the two scales, then the FFMA) exactly that close.
    ins = _instructions(*kernels[name])
    used = {b for x in ins for b in (x.write_barrier, x.read_barrier)} - {7}
    distances = []
    for i, x in enumerate(ins):
        assert x.wait_mask & ~sum(1 << b for b in used) == 0, f"{name}: instruction {i}"
        if x.fp32_op is None:
            continue
        assert x.write_barrier == 7, f"{name}: instruction {i}"
        cycles = x.stall
        for y in ins[i + 1 : i + 8]:
            sources = {y.lo >> 24 & 0xFF, y.lo >> 32 & 0xFF} | (
                {y.hi & 0xFF} if y.is_ffma else set()
            )
            if y.fp32_op is not None and y.opcode >> 9 == 1 and x.dst in sources:
                distances.append(cycles)
                break
            if y.fp32_op is not None and y.dst == x.dst:
                break  # overwritten unread
            cycles += y.stall
    assert min(distances) == 4 if name == "1d1d" else min(distances) >= 4, sorted(distances)


@pytest.mark.parametrize("name", GEMMS)
def test_ffma_runs_are_the_promotions(kernels, name):
    # Every FFMA of the GEMM is FP32 promotion: runs of 64 (a 64-row x 128-column tile per
    # warpgroup, 128 threads: 64 accumulators each), one per promotion site, or of a few sites
    # that ptxas scheduled back to back (at most sass.MAX_RUN_GAP other instructions between
    # them: with the fp32 epilogue's swizzled staging, two of the 1D1D kernel's eight sites form
    # one run of 128), never a part of one.
    ins = _instructions(*kernels[name])
    runs = sass.ffma_runs(ins)
    assert runs and all(len(r) % 64 == 0 for r in runs), [len(r) for r in runs]
    assert sum(map(len, runs)) == sum(i.is_ffma for i in ins)


@needs_disassembler
@pytest.mark.parametrize("mode", PATCH_MODES)
@pytest.mark.parametrize("name", GEMMS)
def test_patch_changes_only_ffma_control_bits(kernels, name, mode, tmp_path):
    cubin, symbol = kernels[name]
    patched, changed = sass.patch_ffma_yield(cubin, symbol, mode)
    assert changed > 0, f"{name} {mode}: nothing changed"
    # Same instructions: the disassembly differs at most in `.reuse`.
    strip = [(a, t.replace(".reuse", "")) for a, t, _, _ in _listing(cubin, symbol, tmp_path)]
    strip_new = [(a, t.replace(".reuse", "")) for a, t, _, _ in _listing(patched, symbol, tmp_path)]
    assert strip_new == strip, f"{name} {mode}: the patched kernel disassembles differently"
    # Bytes: only FFMA high words, only bits 45 and 58-61.
    offset, size = sass.kernel_text(cubin, symbol)
    assert len(patched) == len(cubin)
    assert patched[:offset] == cubin[:offset] and patched[offset + size :] == cubin[offset + size :]
    before, after = _instructions(cubin, symbol), _instructions(patched, symbol)
    diff = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    assert len(diff) == changed
    for i in diff:
        x, y = before[i], after[i]
        assert x.is_ffma and x.lo == y.lo, f"{name} {mode}: instruction {i} is not an FFMA"
        assert (x.hi ^ y.hi) & ~(_NO_YIELD | _REUSE) == 0, f"{name} {mode}: {x.hi:#x} {y.hi:#x}"
        assert not (y.reuse and y.yields)
    runs = sass.ffma_runs(before)
    in_runs = {i for run in runs for i in run}
    assert set(diff) <= in_runs
    for i in in_runs:
        x, y = before[i], after[i]
        if mode == "all":
            assert y.yields and y.reuse == 0, f"{name} all: FFMA {i}"
        elif mode == "none":
            assert not y.yields and y.reuse == x.reuse, f"{name} none: FFMA {i}"
    if mode == "interleave":
        # Only don't-yield FFMAs of a run's first 9/16 change, every other one, to yield.
        num, den = sass.INTERLEAVE_HEAD
        for run in runs:
            head = run[: (len(run) * num + den - 1) // den]
            staying = [i for i in head if not before[i].yields]
            assert [i for i in run if i in diff] == staying[::2]
            assert all(after[i].yields and after[i].reuse == 0 for i in staying[::2])


@pytest.mark.parametrize("name", GEMMS)
def test_patch_counts(kernels, name):
    cubin, symbol = kernels[name]
    ins = _instructions(cubin, symbol)
    in_runs = [ins[i] for run in sass.ffma_runs(ins) for i in run]
    assert sass.patch_ffma_yield(cubin, symbol, "off") == (cubin, 0)
    assert sass.patch_ffma_yield(cubin, symbol, "all")[1] == sum(
        not i.yields or i.reuse != 0 for i in in_runs
    )
    assert sass.patch_ffma_yield(cubin, symbol, "none")[1] == sum(i.yields for i in in_runs)
    # Idempotent: a second pass of "all" / "none" has nothing left to change.
    for mode in ("all", "none"):
        once = sass.patch_ffma_yield(cubin, symbol, mode)[0]
        assert sass.patch_ffma_yield(once, symbol, mode) == (once, 0)


def test_errors(kernels):
    cubin, symbol = kernels["1d2d"]
    with pytest.raises(ValueError, match="cubin: not an ELF"):
        sass.patch_ffma_yield(b"not a cubin" * 10, symbol, "all")
    elf32 = cubin[:4] + b"\x01" + cubin[5:]
    with pytest.raises(ValueError, match="cubin: expected ELF64 little-endian"):
        sass.kernel_text(elf32, symbol)
    with pytest.raises(ValueError, match="cubin: section header"):
        sass.kernel_text(cubin[:1024], symbol)
    with pytest.raises(ValueError, match=r"symbol: no section '\.text\.nope'.*fp8_gemm_nt_kernel"):
        sass.patch_ffma_yield(cubin, "nope", "all")
    with pytest.raises(ValueError, match="mode: expected one of"):
        sass.patch_ffma_yield(cubin, symbol, "sometimes")
    with pytest.raises(TypeError, match="cubin"):
        sass.patch_ffma_yield("text", symbol, "all")
    with pytest.raises(ValueError, match="word: expected 16 bytes"):
        sass.decode(b"\0" * 8)


def test_default_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv(sass.FFMA_YIELD_ENV, raising=False)
    assert sass.default_ffma_yield_mode() == "off"
    monkeypatch.setenv(sass.FFMA_YIELD_ENV, " Interleave ")
    assert sass.default_ffma_yield_mode() == "interleave"
    monkeypatch.setenv(sass.FFMA_YIELD_ENV, "maybe")
    with pytest.raises(ValueError, match=r"PTXTRAIN_JIT_FFMA_YIELD='maybe'.*'interleave'"):
        sass.default_ffma_yield_mode()


def test_patched_kernel_has_its_own_load_key(kernels):
    cubin, symbol = kernels["1d1d"]
    compiled = CompiledKernel(
        name="k", arch="sm_90a", cubin=cubin, symbols={"expr": symbol}, key="abc"
    )
    assert sass.with_ffma_yield(compiled, "off", "expr") is compiled
    keys = {compiled.key}
    for mode in PATCH_MODES:
        patched = sass.with_ffma_yield(compiled, mode, "expr")
        assert patched.key == f"abc:ffma_yield={mode}"
        assert patched.cubin == sass.patch_ffma_yield(cubin, symbol, mode)[0] != cubin
        assert dataclasses.replace(patched, cubin=cubin, key="abc") == compiled
        keys.add(patched.key)
    assert len(keys) == 1 + len(PATCH_MODES)
    unkeyed = dataclasses.replace(compiled, key="")
    assert sass.with_ffma_yield(unkeyed, "all", "expr").key.endswith(":ffma_yield=all")
    assert sass.with_ffma_yield(unkeyed, "all", "expr").key != ":ffma_yield=all"
    with pytest.raises(ValueError, match="mode"):
        sass.with_ffma_yield(compiled, "often", "expr")


def test_ptx_set_ffma_yield(monkeypatch):
    # The GEMM's hook: set_ffma_yield overrides the environment until reset with None.
    monkeypatch.setenv(sass.FFMA_YIELD_ENV, "none")
    try:
        assert ptx._ffma_yield_mode() == "none"
        ptx.set_ffma_yield("interleave")
        assert ptx._ffma_yield_mode() == "interleave"
        ptx.set_ffma_yield("off")
        assert ptx._ffma_yield_mode() == "off"
        with pytest.raises(ValueError, match="mode"):
            ptx.set_ffma_yield("sometimes")
    finally:
        ptx.set_ffma_yield(None)
    assert ptx._ffma_yield_mode() == "none"
