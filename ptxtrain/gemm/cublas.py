"""cuBLAS blockwise FP8 GEMMs through ``torch._scaled_mm`` (the baseline that is always on Hopper).

Design note. PyTorch ≥ 2.9 with CUDA ≥ 12.9 exposes cuBLASLt's DeepSeek-style block scaling through
``torch._scaled_mm``, which infers the recipe from the scale tensors' shapes and strides. For
1D2D the layout that works on the H100/H200 test machines (torch 2.11 + CUDA 13;
docs/design.md §2) is::

    torch._scaled_mm(a_fp8, b_fp8.t(), sf_a_mn_major, sf_b.t(), out_dtype=torch.bfloat16)

with ``sf_a_mn_major = sf_a.t().contiguous().t()`` ([M, ⌈K/128⌉], strides (1, M)) and ``sf_b`` a
contiguous [⌈N/128⌉, ⌈K/128⌉] tensor. For 1D1D (both operands 1x128) the accepted scale layout of
the second operand is not documented, so :func:`fp8_gemm_nt_1d1d` probes the candidate layouts once
per device on a small problem, checks each against the reference, and remembers the first that
works; when none does it raises ``NotImplementedError`` (callers fall back to another backend).
Measured limits (torch 2.11, see :func:`supports`): M % 4 == 0, N % 16 == 0 and K % 512 == 0;
elsewhere cuBLAS fails or, worse, returns wrong numbers, so other shapes raise ``ValueError``
before any launch, and :func:`supports` says so up front.
"""

from __future__ import annotations

import functools

import torch

from ptxtrain._checks import calc_diff
from ptxtrain.gemm import ref

_ALIGN = 16  # cuBLASLt FP8: leading dimensions multiple of 16 bytes (= 16 e4m3 elements)
_K_ALIGN = 512  # 4 scale blocks of 128: see supports()


def supports(m: int, n: int, k: int, *, device: torch.device | None = None) -> bool:
    """Whether cuBLAS blockwise FP8 can run this shape here (CUDA, sm_90, N and K % 16 == 0)."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else device
    if dev.type != "cuda":
        return False
    if _capability(dev.index if dev.index is not None else torch.cuda.current_device()) != (9, 0):
        return False
    # On an H200 with torch 2.11 + CUDA 13:
    # - M % 4 != 0 fails (CUBLAS_STATUS_NOT_SUPPORTED from the heuristic query);
    # - ⌈K/128⌉ < 4 returns WRONG results with no error (calc_diff 5e-2 at K = 128, 1.0 at 256),
    #   and ⌈K/128⌉ % 4 != 0 with several N-blocks is wrong through the Fp8Linear path
    #   (PyTorch's blockwise torch._scaled_mm wants "K-blocks padded to a multiple of 4").
    # So cuBLAS is used only where it is verified: K % 512 == 0 (every DeepSeek-V3 K).
    # (N = 0 or K = 0 have nothing for cuBLAS to do: the other backends handle them.)
    return m > 0 and n > 0 and k > 0 and m % 4 == 0 and n % _ALIGN == 0 and k % _K_ALIGN == 0


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _check_cuda_shape(a: torch.Tensor, n: int, k: int) -> None:
    if a.device.type != "cuda":
        raise ValueError(f"the cublas backend needs CUDA tensors, got a on {a.device}")
    m = a.shape[0]
    if n % _ALIGN or k % _K_ALIGN or m % 4:
        raise ValueError(
            f"the cublas backend needs M % 4 == 0, N % {_ALIGN} == 0 and K % {_K_ALIGN} == 0 "
            f"(cuBLAS blockwise is wrong or unsupported elsewhere), got M={m}, N={n}, K={k}; "
            "use the triton or ref backend"
        )


def _mn_major(sf: torch.Tensor) -> torch.Tensor:
    """``sf`` [R, C] with strides (1, R), the layout cuBLAS reads; no copy when it already is
    (the quantizers' ``sf_layout="mn_major"`` for R % 4 == 0, which cuBLAS needs anyway)."""
    if sf.stride(0) == 1 and sf.stride(1) == sf.shape[0]:
        return sf
    return sf.t().contiguous().t()


def fp8_gemm_nt(
    a: ref.Operand,
    b: ref.Operand,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """cuBLAS 1D2D GEMM with the contract of :func:`ptxtrain.gemm.ref.fp8_gemm_nt`.

    Raises:
        TypeError / ValueError: as the reference, plus non-CUDA tensors or N, K not multiples of 16.
    """
    ref.validate_1d2d(a, b, out, out_dtype)
    return fp8_gemm_nt_unchecked(a, b, out, out_dtype)


def fp8_gemm_nt_unchecked(a, b, out, out_dtype):
    """:func:`fp8_gemm_nt` without its argument checks (the dispatcher's entry, see
    :func:`ptxtrain.gemm.ref.fp8_gemm_nt_unchecked`); still raises ValueError for non-CUDA
    tensors or an M, N, K cuBLAS cannot run (see :func:`supports`)."""
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    m, k = a_fp8.shape
    n = b_fp8.shape[0]
    dtype = out.dtype if out is not None else out_dtype
    if m == 0 or n == 0:
        d = torch.empty(m, n, dtype=dtype, device=a_fp8.device)
        return d if out is None else out
    if k == 0:  # an empty sum: D = 0 (the contract), not a cuBLAS call on empty operands
        return ref.write_out(torch.zeros(m, n, dtype=dtype, device=a_fp8.device), out)
    _check_cuda_shape(a_fp8, n, k)
    # _scaled_mm takes A row-major and B column-major: strided views are copied (no-ops else).
    a_fp8, b_fp8 = a_fp8.contiguous(), b_fp8.contiguous()
    d = torch._scaled_mm(
        a_fp8, b_fp8.t(), _mn_major(sf_a), sf_b.contiguous().t(), out_dtype=dtype
    )  # [M, N]
    return ref.write_out(d, out)


# Candidate (scale_a, scale_b) layouts for 1x128 x 1x128, tried in order; the first that runs and
# matches the reference is kept per device.
# Each takes sf_b [N, ⌈K/128⌉] in either layout and copies only where it is not already the one
# cuBLAS reads: row-major for "a_mn_b_mn" (passed transposed), MN-major for "a_mn_b_mn_contig"
# (its transpose is the contiguous [⌈K/128⌉, N] passed).
_1D1D_LAYOUTS = {
    "a_mn_b_mn": lambda sa, sb: (_mn_major(sa), sb.contiguous().t()),
    "a_mn_b_mn_contig": lambda sa, sb: (_mn_major(sa), sb.t().contiguous()),
}
# The quantizer sf_layout ("row" / "mn_major") of B's scales each layout reads uncopied.
_1D1D_SF_B_LAYOUT = {"a_mn_b_mn": "row", "a_mn_b_mn_contig": "mn_major"}
_1d1d_layout_by_device: dict[int, str | None] = {}


def _probe_1d1d_layout(device: torch.device) -> str | None:
    from ptxtrain.quant import per_token_cast_to_fp8

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 384, device=device, generator=g)
    y = torch.randn(256, 384, device=device, generator=g)
    (qa, sa), (qb, sb) = per_token_cast_to_fp8(x), per_token_cast_to_fp8(y)
    want = x.double() @ y.double().t()
    for name, layout in _1D1D_LAYOUTS.items():
        try:
            s_a, s_b = layout(sa, sb)
            d = torch._scaled_mm(qa, qb.t(), s_a, s_b, out_dtype=torch.float32)
        except (RuntimeError, ValueError):
            continue
        if calc_diff(d, want) < 1e-3:
            return name
    return None


def fp8_gemm_nt_1d1d(
    a: ref.Operand,
    b: ref.Operand,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """cuBLAS 1D1D (wgrad) GEMM with the contract of :func:`ptxtrain.gemm.ref.fp8_gemm_nt_1d1d`.

    Raises:
        TypeError / ValueError: as the reference, plus non-CUDA tensors or N, K not multiples of 16.
        NotImplementedError: this torch/cuBLAS accepts no 1x128 x 1x128 scale layout.
    """
    ref.validate_1d1d(a, b, out, accumulate, out_dtype)
    return fp8_gemm_nt_1d1d_unchecked(a, b, out, accumulate, out_dtype)


def _layout_1d1d(device: torch.device) -> str | None:
    """The 1D1D scale layout this device's cuBLAS takes (probed once per device), or None."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _1d1d_layout_by_device:
        _1d1d_layout_by_device[dev] = _probe_1d1d_layout(device)
    return _1d1d_layout_by_device[dev]


def sf_b_layout_1d1d(device: torch.device) -> str | None:
    """The quantizer ``sf_layout`` (``"row"`` or ``"mn_major"``) of B's 1x128 scales that
    :func:`fp8_gemm_nt_1d1d` passes to cuBLAS without a copy on ``device`` (any layout works;
    the other costs one small copy per call), or None where no 1D1D layout runs (a CUDA device).
    Benchmarks give cuBLAS its own layout so that the copy is not timed against it."""
    return _1D1D_SF_B_LAYOUT.get(_layout_1d1d(device))


def fp8_gemm_nt_1d1d_unchecked(a, b, out, accumulate, out_dtype):
    """:func:`fp8_gemm_nt_1d1d` without its argument checks (the dispatcher's entry, see
    :func:`ptxtrain.gemm.ref.fp8_gemm_nt_1d1d_unchecked`); device and shape errors as there."""
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    m, k = a_fp8.shape
    n = b_fp8.shape[0]
    dtype = torch.float32 if accumulate else (out.dtype if out is not None else out_dtype)
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=dtype, device=a_fp8.device) if out is None else out
    if k == 0:  # an empty sum: D = 0, or ``out`` unchanged when accumulating
        return ref.write_out(torch.zeros(m, n, dtype=dtype, device=a_fp8.device), out, accumulate)
    _check_cuda_shape(a_fp8, n, k)
    layout = _layout_1d1d(a_fp8.device)
    if layout is None:
        raise NotImplementedError(
            f"torch {torch.__version__}'s _scaled_mm accepts no 1x128 x 1x128 scale layout here"
        )
    s_a, s_b = _1D1D_LAYOUTS[layout](sf_a, sf_b)
    a_fp8, b_fp8 = a_fp8.contiguous(), b_fp8.contiguous()  # (as in fp8_gemm_nt_unchecked)
    d = torch._scaled_mm(a_fp8, b_fp8.t(), s_a, s_b, out_dtype=dtype)  # [M, N]
    return ref.write_out(d, out, accumulate)
