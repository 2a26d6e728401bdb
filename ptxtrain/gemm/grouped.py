"""Grouped block-scaled FP8 GEMMs for MoE experts, in Triton.

Design note (DeepGEMM's contracts, docs/design.md §2). Three ops, contracts and validation shared
with their references in :mod:`ptxtrain.gemm.ref` (``*_ref``):

- ``m_grouped_fp8_gemm_nt_contiguous`` (Fprop / Dgrad of the experts): A [M_total, K] holds the
  tokens of each expert contiguously, each expert's slice padded to :data:`M_ALIGNMENT` (128)
  rows; ``m_indices`` [M_total] names each row's expert (-1 = padding row, output zeros); B is
  [G, N, K]. One program per [BLOCK_M, BLOCK_N] output tile of [M_total, N] (BLOCK_M of 64 or 128
  divides the alignment, so a tile lies in one group): it loads the tile's ``m_indices``, takes
  the group from their max (padding rows are -1), stores zeros for an all-padding tile without
  touching K, else runs the dense kernel's tile loop on ``B[g]`` and zeroes padding rows.
- ``m_grouped_fp8_gemm_nt_masked`` (decode): A [G, M_max, K], ``masked_m`` [G]. Grid
  (tiles of [M_max, N], G); tiles at or past ``masked_m[g]`` return at once; rows past
  ``masked_m[g]`` are left untouched (unspecified, as in DeepGEMM). ``masked_m`` is read only on
  the device (clamped to [0, M_max]), so the call never syncs and can be captured in a CUDA graph.
- ``k_grouped_fp8_gemm_nt_contiguous`` (wgrad of the experts): A [M, K_total] and B
  [N, K_total], both 1x128-scaled along K (tokens); group g owns K columns
  ``[S_g, S_g + ks[g])`` with every ``ks[g]`` a multiple of 128. Grid (tiles of [M, N], G); each
  program walks its group's K range with the 1D1D tile loop and writes (or adds into) fp32
  ``D[g]``.

All three reuse :func:`ptxtrain.gemm.triton.block_scaled_tile`: K in steps of 128, one scale
block per step, ``acc += dot * sf_a * sf_b`` in FP32 (the promotion of DeepSeek-V3 report §3.3),
K tails masked. Group offsets into B, sf_b and D are computed in int64. Only the pointer ("tiled")
kernel exists here: a ``GemmConfig`` chooses tiles, warps, stages and the L2 swizzle, its variant
is ignored (no TMA / persistent grouped variant yet).

Dispatch (per call): ``PTXTRAIN_GEMM_BACKEND=ref`` forces the reference; ``auto`` or ``ptx`` send
the m-grouped contiguous (K-major B) and k-grouped GEMMs on sm_90 without a Triton ``config`` to
the PTX kernels (:func:`ptxtrain.gemm.ptx.m_grouped_fp8_gemm_nt_contiguous`,
:func:`ptxtrain.gemm.ptx.k_grouped_fp8_gemm_nt_contiguous`), and the masked one
(:func:`ptxtrain.gemm.ptx.m_grouped_fp8_gemm_nt_masked`) under ``ptx``, or under ``auto`` where
it measured faster than Triton (:func:`masked_ptx_wins`); otherwise CUDA
tensors run the Triton kernels, CPU tensors the reference unless the kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` set before import), where CPU tensors run them too. Any other
forced backend name (``cublas``, ``triton``) runs Triton: cuBLAS has no grouped FP8 GEMM.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ptxtrain import _backend
from ptxtrain._checks import ceil_div
from ptxtrain.gemm import ref
from ptxtrain.gemm.heuristics import BLOCK_K, H100_SMS, GemmConfig, select_config
from ptxtrain.gemm.ref import M_GROUPED_ALIGNMENT, Operand
from ptxtrain.gemm.triton import block_scaled_tile, store_tile, tile_coords

__all__ = [
    "M_ALIGNMENT",
    "get_m_alignment_for_contiguous_layout",
    "k_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "masked_ptx_wins",
]

M_ALIGNMENT = M_GROUPED_ALIGNMENT  # rows per group unit of the contiguous layout (128)
_INT32_MAX = 2**31 - 1


def get_m_alignment_for_contiguous_layout() -> int:
    """Rows each group's slice must be padded to in the m-grouped contiguous layout (128).

    Source: DeepGEMM ``get_m_alignment_for_contiguous_layout``.
    """
    return M_ALIGNMENT


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _m_grouped_contiguous_kernel(
    a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, m_idx_ptr,
    M, N, K, G,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk,
    stride_sfa_m, stride_sfa_k, stride_sfb_g, stride_sfb_n, stride_sfb_k,
    stride_om, stride_on,
    EVEN_K: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    idx = tl.load(m_idx_ptr + offs_m, mask=offs_m < M, other=-1)  # [BM] int32
    grp = tl.max(idx, axis=0)  # the tile's group; -1 when every row is padding
    if (grp >= 0) & (grp < G):
        g64 = grp.to(tl.int64)
        acc = block_scaled_tile(
            a_ptr, b_ptr + g64 * stride_bg, sfa_ptr, sfb_ptr + g64 * stride_sfb_g,
            M, N, K, pid_m, pid_n,
            stride_am, stride_ak, stride_bn, stride_bk,
            stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k,
            False, EVEN_K, False, INT64, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
        )  # fmt: skip
        acc = tl.where((idx == grp)[:, None], acc, 0.0)  # padding rows -> zeros
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    store_tile(
        out_ptr, acc, M, N, pid_m, pid_n, stride_om, stride_on, False, INT64, BLOCK_M, BLOCK_N
    )


@triton.jit
def _m_grouped_masked_kernel(
    a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, masked_m_ptr,
    M_MAX, N, K,
    stride_ag, stride_am, stride_ak, stride_bg, stride_bn, stride_bk,
    stride_sfa_g, stride_sfa_m, stride_sfa_k, stride_sfb_g, stride_sfb_n, stride_sfb_k,
    stride_og, stride_om, stride_on,
    EVEN_K: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    g64 = tl.program_id(1).to(tl.int64)
    rows = tl.load(masked_m_ptr + g64)
    rows = tl.minimum(tl.maximum(rows, 0), M_MAX)  # never read past the group's M_max rows
    num_pid_m = tl.cdiv(M_MAX, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M < rows:
        acc = block_scaled_tile(
            a_ptr + g64 * stride_ag, b_ptr + g64 * stride_bg,
            sfa_ptr + g64 * stride_sfa_g, sfb_ptr + g64 * stride_sfb_g,
            rows, N, K, pid_m, pid_n,
            stride_am, stride_ak, stride_bn, stride_bk,
            stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k,
            False, EVEN_K, False, INT64, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
        )  # fmt: skip
        store_tile(
            out_ptr + g64 * stride_og, acc, rows, N, pid_m, pid_n, stride_om, stride_on,
            False, INT64, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _k_grouped_kernel(
    a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, kb_start_ptr, ks_ptr,
    M, N,
    stride_am, stride_ak, stride_bn, stride_bk,
    stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k,
    stride_og, stride_om, stride_on,
    ACCUMULATE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    g64 = tl.program_id(1).to(tl.int64)
    # The group's first K block; K offsets as block x BLOCK_K so the compiler sees 16-byte
    # aligned operand rows (vector loads).
    kb_start = tl.load(kb_start_ptr + g64)  # int64
    k_start = kb_start * BLOCK_K
    k_len = tl.load(ks_ptr + g64).to(tl.int32)  # a multiple of BLOCK_K
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    acc = block_scaled_tile(
        a_ptr + k_start * stride_ak, b_ptr + k_start * stride_bk,
        sfa_ptr + kb_start * stride_sfa_k, sfb_ptr + kb_start * stride_sfb_k,
        M, N, k_len, pid_m, pid_n,
        stride_am, stride_ak, stride_bn, stride_bk,
        stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k,
        True, True, False, INT64, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
    )  # fmt: skip
    store_tile(
        out_ptr + g64 * stride_og, acc, M, N, pid_m, pid_n, stride_om, stride_on,
        ACCUMULATE, INT64, BLOCK_M, BLOCK_N,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def is_interpreted() -> bool:
    """True when this module's kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_m_grouped_contiguous_kernel, triton.runtime.jit.JITFunction)


def _device_of(a: object) -> torch.device | None:
    """Device of operand ``a``'s data; None when ``a`` is malformed (validation then raises)."""
    if isinstance(a, tuple | list) and len(a) == 2 and isinstance(a[0], torch.Tensor):
        return a[0].device
    return None


_NAMES = ("ref", "cublas", "triton", "ptx")  # PTXTRAIN_GEMM_BACKEND values (as ptxtrain.gemm)


def _use_triton(device: torch.device | None) -> bool:
    """The dispatch rule of the module docstring (None: malformed input, the reference raises)."""
    forced = _backend.requested("PTXTRAIN_GEMM_BACKEND", _NAMES)
    if forced == "ref" or device is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and is_interpreted())


def masked_ptx_wins(m_max: int, k: int) -> bool:
    """Whether ``auto`` sends a masked m-grouped GEMM with ``M_max`` rows per group and depth
    ``K`` to the PTX kernel (pure rule, device not checked).

    From ``benchmarks/bench_grouped.py`` on an H200, random ``masked_m`` in [1, M_max],
    N x K = 4096 x 7168 / 7168 x 2048: PTX over Triton 1.01 / 1.06x at 16 x 64, 1.20 / 1.32x
    at 16 x 128, 0.96 / 1.39x at 8 x 256: the PTX kernel except for M_max > 128 with K > 2048.
    """
    return m_max <= 128 or k <= 2048


def _use_ptx_masked(a: object, b: object, config: GemmConfig | None) -> bool:
    """The PTX masked kernel takes the call with ``PTXTRAIN_GEMM_BACKEND=ptx``, or under ``auto``
    where :func:`masked_ptx_wins`; then as :func:`_use_ptx_contiguous` for a [G, M_max, K] A."""
    forced = _backend.requested("PTXTRAIN_GEMM_BACKEND", _NAMES)
    if forced not in ("auto", "ptx"):
        return False
    if not (_use_ptx_contiguous(a, b, config) and a[0].dim() == 3):
        return False
    return forced == "ptx" or masked_ptx_wins(a[0].shape[1], a[0].shape[2])


def _use_ptx_k_grouped(a: object, b: object, config: GemmConfig | None) -> bool:
    """The PTX k-grouped kernel takes the call: ``auto`` or ``ptx`` forced, no Triton ``config``,
    CUDA operands of a shape :func:`ptxtrain.gemm.ptx.supports` (sm_90, ΣK a multiple of 16)."""
    if _backend.requested("PTXTRAIN_GEMM_BACKEND", _NAMES) not in ("auto", "ptx"):
        return False
    if config is not None or _device_of(a) is None or _device_of(b) is None:
        return False
    a_fp8, b_fp8 = a[0], b[0]
    if a_fp8.dim() != 2 or b_fp8.dim() != 2 or a_fp8.device.type != "cuda":
        return False
    from ptxtrain.gemm import ptx

    return ptx.supports(a_fp8.shape[0], b_fp8.shape[0], a_fp8.shape[1], device=a_fp8.device)


def _use_ptx_contiguous(a: object, b: object, config: GemmConfig | None) -> bool:
    """The PTX m-grouped kernel takes the call: ``auto`` or ``ptx`` forced, no Triton ``config``,
    a K-major [G, N, K] B (a transposed view stays on Triton, which reads strides, instead of
    being copied) and a shape :func:`ptxtrain.gemm.ptx.supports` (sm_90, K % 16 == 0)."""
    if _backend.requested("PTXTRAIN_GEMM_BACKEND", _NAMES) not in ("auto", "ptx"):
        return False
    if config is not None or _device_of(a) is None or _device_of(b) is None:
        return False
    b_fp8 = b[0]
    if b_fp8.dim() != 3 or not b_fp8.is_contiguous() or b_fp8.device.type != "cuda":
        return False
    from ptxtrain.gemm import ptx

    return ptx.supports(a[0].shape[0], b_fp8.shape[1], b_fp8.shape[2], device=b_fp8.device)


def _check_triton_device(device: torch.device) -> None:
    if device.type != "cuda" and not (device.type == "cpu" and is_interpreted()):
        raise ValueError(
            f"the Triton grouped FP8 GEMMs need CUDA tensors, got {device} (CPU tensors run only "
            "under TRITON_INTERPRET=1; the *_ref functions of ptxtrain.gemm.ref run anywhere)"
        )


def _config(config: GemmConfig | None, m: int, n: int, k: int, kind: str) -> GemmConfig:
    if config is None:
        return select_config(m, n, k, kind, H100_SMS)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None, got {config!r}")
    return config


def _needs_int64(*tensors: torch.Tensor) -> bool:
    return any(
        sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s) > _INT32_MAX
        for t in tensors
    )


def _on_device(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _contiguous_triton(a, b, m_indices, out, out_dtype, check_indices, config) -> torch.Tensor:
    m, n, k, g = ref.validate_m_grouped_contiguous(a, b, m_indices, out, out_dtype, check_indices)
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    _check_triton_device(a_fp8.device)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a_fp8.device)
    if m == 0 or n == 0:
        return out
    if k == 0 or g == 0:
        return out.zero_()
    cfg = _config(config, m, n, k, "1d2d")
    m_indices = m_indices.contiguous()  # the kernel reads it with unit stride
    grid = (ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n),)
    with _on_device(a_fp8.device):
        _m_grouped_contiguous_kernel[grid](
            a_fp8, b_fp8, sf_a, sf_b, out, m_indices, m, n, k, g,
            a_fp8.stride(0), a_fp8.stride(1), *b_fp8.stride(),
            sf_a.stride(0), sf_a.stride(1), *sf_b.stride(),
            out.stride(0), out.stride(1),
            EVEN_K=k % BLOCK_K == 0,
            INT64=_needs_int64(a_fp8, sf_a, b_fp8[0], sf_b[0], out),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K,
            GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def m_grouped_fp8_gemm_nt_masked_triton(
    a, b, masked_m, expected_m=None, out=None, out_dtype=torch.bfloat16, config=None
) -> torch.Tensor:
    """:func:`m_grouped_fp8_gemm_nt_masked` on its Triton kernel whatever ``auto`` would pick
    (``benchmarks/bench_grouped.py`` times it against the PTX kernel): the same arguments (A
    [G, M_max, K] and B [G, N, K] e4m3 operands with fp32 scales, ``masked_m`` [G] int32,
    ``expected_m`` int or None, ``out`` [G, M_max, N] or None, ``out_dtype`` bfloat16 / float32,
    ``config`` a :class:`~ptxtrain.gemm.heuristics.GemmConfig` or None), checks and result;
    ``masked_m`` is not read on the host.

    Raises:
        TypeError / ValueError: as :func:`m_grouped_fp8_gemm_nt_masked`, plus tensors not on
            CUDA (the CPU only under ``TRITON_INTERPRET=1``) or a ``config`` that is not a
            :class:`~ptxtrain.gemm.heuristics.GemmConfig`.
    """
    g, m_max, n, k = ref.validate_m_grouped_masked(
        a, b, masked_m, expected_m, out, out_dtype, check_masked_m=False
    )
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    _check_triton_device(a_fp8.device)
    if out is None:
        out = torch.empty((g, m_max, n), dtype=out_dtype, device=a_fp8.device)
    if g == 0 or m_max == 0 or n == 0:
        return out
    if k == 0:
        # D = 0 on the valid rows; rows past masked_m are unspecified, so zero them all.
        return out.zero_()
    # Tiles as for the rows the groups hold in total (expected_m per group when given).
    m_hint = g * (m_max if expected_m is None else max(expected_m, 1))
    cfg = _config(config, m_hint, n, k, "1d2d")
    masked_m = masked_m.contiguous()  # the kernel reads it with unit stride
    grid = (ceil_div(m_max, cfg.block_m) * ceil_div(n, cfg.block_n), g)
    with _on_device(a_fp8.device):
        _m_grouped_masked_kernel[grid](
            a_fp8, b_fp8, sf_a, sf_b, out, masked_m, m_max, n, k,
            *a_fp8.stride(), *b_fp8.stride(), *sf_a.stride(), *sf_b.stride(), *out.stride(),
            EVEN_K=k % BLOCK_K == 0,
            INT64=_needs_int64(a_fp8[0], sf_a[0], b_fp8[0], sf_b[0], out[0]),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K,
            GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def _k_grouped_triton(a, b, ks, ks_tensor, out, accumulate, config) -> torch.Tensor:
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if ks_tensor is None:
        m, n, ks = ref.validate_k_grouped(a, b, ks, out, accumulate)
        g = len(ks)
        typical_k = max(ks) if ks else 0
    else:
        m, n, g = ref.validate_k_grouped_device(a, b, ks_tensor, out, accumulate)
        typical_k = ceil_div(a_fp8.shape[1], max(g, 1))  # sizes unknown on the host
    _check_triton_device(a_fp8.device)
    if out is None:
        out = torch.empty((g, m, n), dtype=torch.float32, device=a_fp8.device)
    if g == 0 or m == 0 or n == 0:
        return out
    if ks_tensor is None:
        starts = [0]
        for kg in ks[:-1]:
            starts.append(starts[-1] + kg)
        kb_start = [s // BLOCK_K for s in starts]
        kb_start = torch.tensor(kb_start, dtype=torch.int64).to(a_fp8.device, non_blocking=True)
        k_len = torch.tensor(ks, dtype=torch.int64).to(a_fp8.device, non_blocking=True)
    else:  # device ops only: no host sync
        k_len = ks_tensor.to(torch.int64)
        kb_start = (torch.cumsum(k_len, 0) - k_len) // BLOCK_K
    cfg = _config(config, m, n, typical_k, "1d1d")
    grid = (ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n), g)
    with _on_device(a_fp8.device):
        _k_grouped_kernel[grid](
            a_fp8, b_fp8, sf_a, sf_b, out, kb_start, k_len, m, n,
            *a_fp8.stride(), *b_fp8.stride(), *sf_a.stride(), *sf_b.stride(), *out.stride(),
            ACCUMULATE=accumulate,
            INT64=_needs_int64(a_fp8, sf_a, b_fp8, sf_b, out[0]),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K,
            GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def m_grouped_fp8_gemm_nt_contiguous(
    a: Operand,
    b: Operand,
    m_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    check_indices: bool = True,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """M-grouped ``D[r] = A[r] · B[m_indices[r]]ᵀ`` over expert-contiguous rows (PTX, Triton or
    ref: on an sm_90 GPU the PTX kernel
    (:func:`ptxtrain.gemm.ptx.m_grouped_fp8_gemm_nt_contiguous`) for a K-major B when no Triton
    ``config`` is given, else Triton).

    Contract, shapes, dtypes and errors:
    :func:`ptxtrain.gemm.ref.m_grouped_fp8_gemm_nt_contiguous_ref` (each group's rows padded to
    :data:`M_ALIGNMENT`, -1 = padding row → zeros; A [M_total, K] 1x128-scaled, B [G, N, K]
    128x128-scaled; bf16/fp32 [M_total, N] out).

    Args:
        check_indices: check ``m_indices``' values first (one host sync; pass False under CUDA
            graphs — the kernel then writes zeros for any tile holding an out-of-range index).
        config: tiles / warps / stages (variant ignored); None picks
            :func:`ptxtrain.gemm.heuristics.select_config`'s for the total M.

    Raises:
        TypeError / ValueError: as the reference; ``config`` not a GemmConfig (Triton path);
            ``PTXTRAIN_GEMM_BACKEND`` holding an unknown name.

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous``; DeepSeek-V3 report §3.3;
    docs/design.md §2.
    """
    if _use_ptx_contiguous(a, b, config):
        from ptxtrain.gemm import ptx

        return ptx.m_grouped_fp8_gemm_nt_contiguous(
            a, b, m_indices, out=out, out_dtype=out_dtype, check_indices=check_indices
        )
    if _use_triton(_device_of(a)):
        return _contiguous_triton(a, b, m_indices, out, out_dtype, check_indices, config)
    return ref.m_grouped_fp8_gemm_nt_contiguous_ref(
        a, b, m_indices, out=out, out_dtype=out_dtype, check_indices=check_indices
    )


def m_grouped_fp8_gemm_nt_masked(
    a: Operand,
    b: Operand,
    masked_m: torch.Tensor,
    expected_m: int | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Masked m-grouped ``D[g, :masked_m[g]] = A[g, :masked_m[g]] · B[g]ᵀ`` (Triton or ref).

    Contract, shapes, dtypes and errors: :func:`ptxtrain.gemm.ref.m_grouped_fp8_gemm_nt_masked_ref`
    (A [G, M_max, K], B [G, N, K], ``masked_m`` [G] int32; D [G, M_max, N]). Rows at or past
    ``masked_m[g]`` are unspecified: the Triton kernel leaves them as they were (``torch.empty``
    when ``out`` is None), the reference writes zeros. The Triton path does not read ``masked_m``
    on the host (no sync; values are clamped to [0, M_max] on the device), so out-of-range values
    raise only on the reference path.

    Args:
        expected_m: hint of the typical rows per group; picks the tiles (None: M_max).
        config: as in :func:`m_grouped_fp8_gemm_nt_contiguous`.

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_masked``; docs/design.md §2.
    """
    if _use_ptx_masked(a, b, config):
        from ptxtrain.gemm import ptx

        return ptx.m_grouped_fp8_gemm_nt_masked(
            a, b, masked_m, expected_m, out=out, out_dtype=out_dtype
        )
    if _use_triton(_device_of(a)):
        return m_grouped_fp8_gemm_nt_masked_triton(
            a, b, masked_m, expected_m, out, out_dtype, config
        )
    return ref.m_grouped_fp8_gemm_nt_masked_ref(
        a, b, masked_m, expected_m, out=out, out_dtype=out_dtype
    )


def k_grouped_fp8_gemm_nt_contiguous(
    a: Operand,
    b: Operand,
    ks: list[int] | torch.Tensor | None,
    *,
    ks_tensor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """K-grouped ``D[g] (+)= A_g · B_gᵀ`` over contiguous K (token) slices, fp32 (PTX, Triton
    or ref).

    Contract, shapes, dtypes, the padding rule (each group's K a multiple of 128) and errors:
    :func:`ptxtrain.gemm.ref.k_grouped_fp8_gemm_nt_contiguous_ref` (A [M, K_total],
    B [N, K_total], both 1x128-scaled along K; D [G, M, N] float32). ``ks`` as a tensor is read
    back to the host (one sync); pass a list, or ``ks=None`` and the sizes as ``ks_tensor`` (a
    device tensor read by the kernel only, summing to at most K_total: no host sync, CUDA-graph
    safe; how the MoE experts' wgrad runs).

    Args:
        config: as in :func:`m_grouped_fp8_gemm_nt_contiguous` (chosen for one group's M, N).

    Source: DeepGEMM ``k_grouped_fp8_gemm_nt_contiguous`` (``ks`` / ``ks_tensor``); DeepSeek-V3
    report §3.3; docs/design.md §2.
    """
    ref.check_one_of_ks(ks, ks_tensor)
    if _use_ptx_k_grouped(a, b, config):
        from ptxtrain.gemm import ptx

        return ptx.k_grouped_fp8_gemm_nt_contiguous(
            a, b, ks, ks_tensor=ks_tensor, out=out, accumulate=accumulate
        )
    if _use_triton(_device_of(a)):
        return _k_grouped_triton(a, b, ks, ks_tensor, out, accumulate, config)
    return ref.k_grouped_fp8_gemm_nt_contiguous_ref(
        a, b, ks, ks_tensor=ks_tensor, out=out, accumulate=accumulate
    )


def _compile_for_sm90(op: str, config: GemmConfig | None = None, out_dtype=torch.bfloat16):
    """Compile one grouped kernel (``op``: "contiguous", "masked" or "k_grouped") for sm_90a
    without a GPU; returns Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.asm["cubin"]``) for
    instruction- and register-level checks on a CPU-only machine. Not under the interpreter.
    """
    if is_interpreted():
        raise RuntimeError("_compile_for_sm90 needs the compiled (not interpreted) kernels")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = {
        "contiguous": _m_grouped_contiguous_kernel,
        "masked": _m_grouped_masked_kernel,
        "k_grouped": _k_grouped_kernel,
    }[op]
    cfg = config or GemmConfig()
    pointers = {
        "a_ptr": "*fp8e4nv",
        "b_ptr": "*fp8e4nv",
        "sfa_ptr": "*fp32",
        "sfb_ptr": "*fp32",
        "out_ptr": "*fp32"
        if op == "k_grouped"
        else f"*{'bf16' if out_dtype == torch.bfloat16 else 'fp32'}",
        "m_idx_ptr": "*i32",
        "masked_m_ptr": "*i32",
        "kb_start_ptr": "*i64",
        "ks_ptr": "*i64",
    }
    constexprs = {
        "EVEN_K": True,
        "ACCUMULATE": False,
        "INT64": False,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": BLOCK_K,
        "GROUP_M": cfg.group_m,
        "NUM_STAGES": cfg.num_stages,
        # K-major operands and row-major outputs: unit inner strides, as the launcher would see.
        "stride_ak": 1,
        "stride_bk": 1,
        "stride_on": 1,
    }
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "i32")
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    # 16-divisible pointers, sizes and data strides, as the launcher sees (and specializes on)
    # for the DeepSeek-V3 expert shapes.
    data_strides = ("stride_ag", "stride_am", "stride_bg", "stride_bn", "stride_og", "stride_om")
    aligned = [n for n in kernel.arg_names if n in pointers or n in ("N", "K", *data_strides)]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
