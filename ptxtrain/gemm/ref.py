"""Reference block-scaled FP8 GEMMs (pure PyTorch): the oracle for every GEMM kernel.

Design note. Names and contracts follow DeepGEMM (DESIGN §2). "NT" means ``D = A · Bᵀ`` with both
operands K-major: A [M, K], B [N, K]. An operand is passed as a pair ``(x_fp8, sf)``:

- ``fp8_gemm_nt`` ("1D2D", Fprop and Dgrad): A scaled per 1x128 tile (sf_a [M, ⌈K/128⌉]), B per
  128x128 block (sf_b [⌈N/128⌉, ⌈K/128⌉]); output bf16 or fp32.
- ``fp8_gemm_nt_1d1d`` (Wgrad): both operands scaled per 1x128 tile along K (sf_a [M, ⌈K/128⌉],
  sf_b [N, ⌈K/128⌉]); output fp32 (optionally accumulated into an existing fp32 tensor) or bf16
  (a weight gradient written straight in the weight's dtype).

The reference dequantizes both operands to fp32 and multiplies in fp32. That equals the exact
block-scaled sum up to fp32 rounding, which is what a kernel with per-128-K FP32 promotion
approximates; tests compare kernels and this reference against a matmul of the *unquantized*
inputs with ``calc_diff < 1e-3``. K = 0 gives zeros (or leaves ``out`` unchanged when
accumulating).
"""

from __future__ import annotations

import torch

from ptxtrain._checks import ceil_div, check_same_device, check_tensor
from ptxtrain.quant.ref import BLOCK, FP8_DTYPE, per_block_cast_back, per_token_cast_back

Operand = tuple[torch.Tensor, torch.Tensor]


def _unpack(name: str, operand: object) -> Operand:
    if not (isinstance(operand, tuple | list) and len(operand) == 2):
        raise TypeError(f"{name} must be a pair (x_fp8, sf), got {type(operand).__name__}")
    x, sf = operand
    check_tensor(f"{name}[0] (fp8 data)", x, dtypes=(FP8_DTYPE,), ndim=2)
    check_tensor(f"{name}[1] (sf)", sf, dtypes=(torch.float32,), ndim=2)
    return x, sf


def _check_sf(name: str, sf: torch.Tensor, want: tuple[int, int], layout: str) -> None:
    if tuple(sf.shape) != want:
        raise ValueError(f"{name} sf must have shape {want} ({layout}), got {tuple(sf.shape)}")


def _check_pair_shapes(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    m, k = a.shape
    n, kb = b.shape
    if k != kb:
        raise ValueError(
            f"a and b must share K (both K-major: a [M, K], b [N, K]), got a {tuple(a.shape)} "
            f"and b {tuple(b.shape)}"
        )
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    return m, n, k


def _check_out(out: torch.Tensor, shape: tuple[int, int], dtypes, device) -> None:
    check_tensor("out", out, dtypes=dtypes, ndim=2)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape} ([M, N]), got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out must be on {device} like a and b, got {out.device}")


def validate_1d2d(
    a: object, b: object, out: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[int, int, int]:
    """Check the arguments of any ``fp8_gemm_nt`` backend; return (M, N, K).

    Raises:
        TypeError / ValueError: see :func:`fp8_gemm_nt`.
    """
    a_fp8, sf_a = _unpack("a", a)
    b_fp8, sf_b = _unpack("b", b)
    m, n, k = _check_pair_shapes(a_fp8, b_fp8)
    _check_sf("a", sf_a, (m, ceil_div(k, BLOCK)), "[M, ⌈K/128⌉], one per 1x128 tile")
    _check_sf("b", sf_b, (ceil_div(n, BLOCK), ceil_div(k, BLOCK)), "[⌈N/128⌉, ⌈K/128⌉]")
    check_same_device(a=a_fp8, sf_a=sf_a, b=b_fp8, sf_b=sf_b)
    if out is not None:
        _check_out(out, (m, n), (torch.bfloat16, torch.float32), a_fp8.device)
    elif out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return m, n, k


def validate_1d1d(
    a: object,
    b: object,
    out: torch.Tensor | None,
    accumulate: bool,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[int, int, int]:
    """Check the arguments of any ``fp8_gemm_nt_1d1d`` backend; return (M, N, K).

    Raises:
        TypeError / ValueError: see :func:`fp8_gemm_nt_1d1d`.
    """
    a_fp8, sf_a = _unpack("a", a)
    b_fp8, sf_b = _unpack("b", b)
    m, n, k = _check_pair_shapes(a_fp8, b_fp8)
    _check_sf("a", sf_a, (m, ceil_div(k, BLOCK)), "[M, ⌈K/128⌉], one per 1x128 tile")
    _check_sf("b", sf_b, (n, ceil_div(k, BLOCK)), "[N, ⌈K/128⌉], one per 1x128 tile")
    check_same_device(a=a_fp8, sf_a=sf_a, b=b_fp8, sf_b=sf_b)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out (the fp32 tensor to add into)")
    if out is not None:
        _check_out(out, (m, n), (torch.float32, torch.bfloat16), a_fp8.device)
        if accumulate and out.dtype != torch.float32:
            raise TypeError(
                f"accumulate=True needs a float32 out (sums of many steps stay in fp32), "
                f"got {out.dtype}"
            )
    elif out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    return m, n, k


def write_out(d: torch.Tensor, out: torch.Tensor | None, accumulate: bool = False) -> torch.Tensor:
    """Epilogue of backends that compute D into a fresh tensor.

    Returns ``d`` when no ``out`` was given; else copies (with ``accumulate``, adds) ``d`` into
    ``out`` and returns ``out``.
    """
    if out is None:
        return d
    if accumulate:
        out.add_(d)
    else:
        out.copy_(d)
    return out


def fp8_gemm_nt(
    a: Operand,
    b: Operand,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``D = A · Bᵀ`` with A scaled per 1x128 tile and B per 128x128 block ("1D2D").

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [M, K] float8_e4m3fn (K-major); sf_a [M, ⌈K/128⌉] float32.
        b: ``(b_fp8, sf_b)``: b_fp8 [N, K] float8_e4m3fn (K-major); sf_b [⌈N/128⌉, ⌈K/128⌉]
            float32.
        out: optional [M, N] output written in place (its dtype wins over ``out_dtype``).
        out_dtype: torch.bfloat16 or torch.float32 when ``out`` is None.

    Returns:
        D [M, N] of ``out_dtype`` (``out`` itself when given). Any M, N, K, 0 included.

    Raises:
        TypeError: operands not ``(float8_e4m3fn, float32)`` pairs, bad ``out_dtype``.
        ValueError: ranks, mismatched K, scale shapes, devices or ``out`` shape wrong.

    Source: DeepGEMM ``fp8_gemm_nt``; DESIGN §2.
    """
    validate_1d2d(a, b, out, out_dtype)
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if out is not None:
        out_dtype = out.dtype
    a_hp = per_token_cast_back(a_fp8, sf_a)  # [M, K] fp32
    b_hp = per_block_cast_back(b_fp8, sf_b)  # [N, K] fp32
    d = (a_hp @ b_hp.t()).to(out_dtype)  # [M, N]
    return write_out(d, out)


def fp8_gemm_nt_1d1d(
    a: Operand,
    b: Operand,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``D (+)= A · Bᵀ`` with both operands scaled per 1x128 tile along K ("1D1D", wgrad).

    For an FP8 Linear's weight gradient ``dW [N, K] = dyᵀ · x``, A is ``dyᵀ`` [N, M] and B is
    ``xᵀ`` [K, M], both quantized 1x128 along the token dimension (see
    :func:`ptxtrain.quant.per_token_cast_to_fp8_t`); this function's K is then the token count.

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [M, K] float8_e4m3fn; sf_a [M, ⌈K/128⌉] float32.
        b: ``(b_fp8, sf_b)``: b_fp8 [N, K] float8_e4m3fn; sf_b [N, ⌈K/128⌉] float32.
        out: optional [M, N] float32 or bfloat16 output (its dtype wins over ``out_dtype``).
        accumulate: add into ``out`` (which must then be given, float32) instead of
            overwriting it.
        out_dtype: torch.float32 (default, DeepGEMM's wgrad) or torch.bfloat16 (one rounding of
            the fp32 sum) when ``out`` is None.

    Returns:
        D [M, N] in ``out_dtype`` (``out`` itself when given).

    Raises:
        TypeError: as :func:`fp8_gemm_nt`; ``out_dtype`` / ``out`` not float32 or bfloat16;
            ``accumulate=True`` with a bfloat16 ``out``.
        ValueError: as :func:`fp8_gemm_nt`; ``accumulate=True`` without ``out``.

    Source: DeepGEMM ``fp8_gemm_nt`` 1D1D / ``wgrad_gemm_fp8_fp8_fp32_nt``; DESIGN §2.
    """
    validate_1d1d(a, b, out, accumulate, out_dtype)
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if out is not None:
        out_dtype = out.dtype
    a_hp = per_token_cast_back(a_fp8, sf_a)  # [M, K] fp32
    b_hp = per_token_cast_back(b_fp8, sf_b)  # [N, K] fp32
    d = a_hp @ b_hp.t()  # [M, N] fp32
    if not accumulate:
        d = d.to(out_dtype)
    return write_out(d, out, accumulate)
