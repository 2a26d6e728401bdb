"""Reference block-scaled FP8 GEMMs (pure PyTorch): the oracle for every GEMM kernel.

Design note. Names and contracts follow DeepGEMM (docs/design.md §2). "NT" means ``D = A · Bᵀ`` with
both operands K-major: A [M, K], B [N, K]. An operand is passed as a pair ``(x_fp8, sf)``:

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

    Source: DeepGEMM ``fp8_gemm_nt``; docs/design.md §2.
    """
    validate_1d2d(a, b, out, out_dtype)
    return fp8_gemm_nt_unchecked(a, b, out, out_dtype)


def fp8_gemm_nt_unchecked(a: Operand, b: Operand, out, out_dtype) -> torch.Tensor:
    """:func:`fp8_gemm_nt` without its argument checks: the entry every GEMM backend module
    defines with this signature, which :mod:`ptxtrain.gemm`'s dispatcher (and ``Fp8Linear``)
    call after validating once.

    Args:
        a: ``(a_fp8 [M, K] float8_e4m3fn, sf_a [M, ⌈K/128⌉] float32)``, any strides.
        b: ``(b_fp8 [N, K] float8_e4m3fn, sf_b [⌈N/128⌉, ⌈K/128⌉] float32)``.
        out: [M, N] bfloat16 / float32 D written in place (its dtype wins), or None.
        out_dtype: D's dtype when ``out`` is None.

    Returns:
        D [M, N] (``out`` itself when given).

    Raises nothing of its own: arguments :func:`validate_1d2d` refuses give torch's errors or a
    wrong D (a backend still raises ValueError for a device or shape it cannot run).
    """
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

    Source: DeepGEMM ``fp8_gemm_nt`` 1D1D / ``wgrad_gemm_fp8_fp8_fp32_nt``; docs/design.md §2.
    """
    validate_1d1d(a, b, out, accumulate, out_dtype)
    return fp8_gemm_nt_1d1d_unchecked(a, b, out, accumulate, out_dtype)


def fp8_gemm_nt_1d1d_unchecked(a: Operand, b: Operand, out, accumulate, out_dtype) -> torch.Tensor:
    """:func:`fp8_gemm_nt_1d1d` without its argument checks: every backend's entry for the
    dispatcher, as :func:`fp8_gemm_nt_unchecked`, with arguments :func:`validate_1d1d` accepts
    (``sf_b`` [N, ⌈K/128⌉]; ``accumulate``: D += A·Bᵀ into a float32 ``out``)."""
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if out is not None:
        out_dtype = out.dtype
    a_hp = per_token_cast_back(a_fp8, sf_a)  # [M, K] fp32
    b_hp = per_token_cast_back(b_fp8, sf_b)  # [N, K] fp32
    d = a_hp @ b_hp.t()  # [M, N] fp32
    if not accumulate:
        d = d.to(out_dtype)
    return write_out(d, out, accumulate)


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs (MoE experts; docs/design.md §2). Backends: ptxtrain.gemm.grouped.
# ----------------------------------------------------------------------------------------------

# Rows per alignment unit of the m-grouped contiguous layout: each group's rows start at a multiple
# of this (DeepGEMM's ``get_m_alignment_for_contiguous_layout()``), so an M tile of 64 or 128 rows
# never spans two groups. ``ptxtrain.moe.permute_quant(..., align=M_GROUPED_ALIGNMENT)`` builds it.
M_GROUPED_ALIGNMENT = 128
# Each group's K (tokens) in the k-grouped wgrad GEMM is a multiple of this: one 1x128 scale tile
# never spans two experts.
K_GROUPED_ALIGNMENT = BLOCK


def _unpack_nd(name: str, operand: object, ndim: int) -> Operand:
    if not (isinstance(operand, tuple | list) and len(operand) == 2):
        raise TypeError(f"{name} must be a pair (x_fp8, sf), got {type(operand).__name__}")
    x, sf = operand
    check_tensor(f"{name}[0] (fp8 data)", x, dtypes=(FP8_DTYPE,), ndim=ndim)
    check_tensor(f"{name}[1] (sf)", sf, dtypes=(torch.float32,), ndim=ndim)
    return x, sf


def _check_grouped_out(out: torch.Tensor, shape: tuple[int, ...], dtypes, device, what) -> None:
    check_tensor("out", out, dtypes=dtypes, ndim=len(shape))
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape} ({what}), got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out must be on {device} like a and b, got {out.device}")


def _check_b_grouped(b: object, k: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """B of the m-grouped GEMMs: ([G, N, K] fp8, [G, ⌈N/128⌉, ⌈K/128⌉] fp32); returns (.., G, N)."""
    b_fp8, sf_b = _unpack_nd("b", b, 3)
    g, n, kb = b_fp8.shape
    if kb != k:
        raise ValueError(
            f"a and b must share K (a [.., K], b [G, N, K]), got K = {k} for a and b "
            f"{tuple(b_fp8.shape)}"
        )
    want = (g, ceil_div(n, BLOCK), ceil_div(k, BLOCK))
    _check_sf("b", sf_b, want, "[G, ⌈N/128⌉, ⌈K/128⌉], one per 128x128 block of each group")
    return b_fp8, sf_b, g, n


def _check_out_dtype(out: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    if out is None and out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def check_m_indices_values(m_indices: torch.Tensor, num_groups: int) -> None:
    """Check the values of a validated ``m_indices`` (one host sync).

    Every entry must lie in ``[-1, G)``, and the non-padding entries of each
    ``M_GROUPED_ALIGNMENT``-row chunk must name one group (each group's rows start on the
    alignment; padding rows, -1, may sit anywhere).

    Raises:
        ValueError: an entry is out of range, or a chunk mixes two groups.
    """
    if m_indices.numel() == 0:
        return
    idx = m_indices.to(torch.int64)
    lo, hi = int(idx.min()), int(idx.max())  # one sync each; small next to the GEMM on CPU
    if lo < -1 or hi >= num_groups:
        raise ValueError(
            f"m_indices must lie in [-1, {num_groups}) (-1 = padding row, else the group of the "
            f"row, G = {num_groups}), got values in [{lo}, {hi}]"
        )
    chunks = idx.view(-1, M_GROUPED_ALIGNMENT)  # [M/align, align]
    top = chunks.max(dim=1).values  # [M/align]
    low = torch.where(chunks < 0, num_groups, chunks).min(dim=1).values
    mixed = (top >= 0) & (low != top)
    if bool(mixed.any()):
        c = int(mixed.nonzero()[0])
        raise ValueError(
            f"m_indices must give each {M_GROUPED_ALIGNMENT}-row chunk a single group (pad each "
            f"group's rows to a multiple of {M_GROUPED_ALIGNMENT}, e.g. with "
            f"ptxtrain.moe.permute_quant(..., align={M_GROUPED_ALIGNMENT})); rows "
            f"[{c * M_GROUPED_ALIGNMENT}, {(c + 1) * M_GROUPED_ALIGNMENT}) mix groups "
            f"{int(low[c])} and {int(top[c])}"
        )


def validate_m_grouped_contiguous(
    a: object,
    b: object,
    m_indices: object,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    check_indices: bool = True,
) -> tuple[int, int, int, int]:
    """Check the arguments of any ``m_grouped_fp8_gemm_nt_contiguous`` backend.

    Returns:
        (M_total, N, K, G).

    Raises:
        TypeError / ValueError: see :func:`m_grouped_fp8_gemm_nt_contiguous_ref`.
    """
    a_fp8, sf_a = _unpack("a", a)
    m, k = a_fp8.shape
    _check_sf("a", sf_a, (m, ceil_div(k, BLOCK)), "[M_total, ⌈K/128⌉], one per 1x128 tile")
    b_fp8, sf_b, g, n = _check_b_grouped(b, k)
    check_tensor("m_indices", m_indices, dtypes=(torch.int32,), ndim=1)
    if m_indices.shape[0] != m:
        raise ValueError(
            f"m_indices must have one entry per row of a ({m}), got shape {tuple(m_indices.shape)}"
        )
    if m % M_GROUPED_ALIGNMENT:
        raise ValueError(
            f"a must have a multiple of {M_GROUPED_ALIGNMENT} rows (each group padded to "
            f"M_ALIGNMENT = {M_GROUPED_ALIGNMENT} rows, padding rows marked -1 in m_indices), "
            f"got {m}"
        )
    check_same_device(a=a_fp8, sf_a=sf_a, b=b_fp8, sf_b=sf_b, m_indices=m_indices)
    if out is not None:
        dtypes = (torch.bfloat16, torch.float32)
        _check_grouped_out(out, (m, n), dtypes, a_fp8.device, "[M_total, N]")
    _check_out_dtype(out, out_dtype)
    if check_indices:
        check_m_indices_values(m_indices, g)
    return m, n, k, g


def validate_m_grouped_masked(
    a: object,
    b: object,
    masked_m: object,
    expected_m: object,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    check_masked_m: bool = True,
) -> tuple[int, int, int, int]:
    """Check the arguments of any ``m_grouped_fp8_gemm_nt_masked`` backend.

    ``check_masked_m`` reads ``masked_m`` back (a host sync) to check its range.

    Returns:
        (G, M_max, N, K).

    Raises:
        TypeError / ValueError: see :func:`m_grouped_fp8_gemm_nt_masked_ref`.
    """
    a_fp8, sf_a = _unpack_nd("a", a, 3)
    g, m_max, k = a_fp8.shape
    want = (g, m_max, ceil_div(k, BLOCK))
    _check_sf("a", sf_a, want, "[G, M_max, ⌈K/128⌉], one per 1x128 tile")
    b_fp8, sf_b, gb, n = _check_b_grouped(b, k)
    if gb != g:
        raise ValueError(
            f"a and b must have the same number of groups, got a {tuple(a_fp8.shape)} and "
            f"b {tuple(b_fp8.shape)}"
        )
    check_tensor("masked_m", masked_m, dtypes=(torch.int32,), ndim=1)
    if masked_m.shape[0] != g:
        raise ValueError(
            f"masked_m must have one entry per group ({g}), got shape {tuple(masked_m.shape)}"
        )
    if expected_m is not None and (
        isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 0
    ):
        raise ValueError(f"expected_m must be None or an int >= 0, got {expected_m!r}")
    check_same_device(a=a_fp8, sf_a=sf_a, b=b_fp8, sf_b=sf_b, masked_m=masked_m)
    if out is not None:
        dtypes = (torch.bfloat16, torch.float32)
        _check_grouped_out(out, (g, m_max, n), dtypes, a_fp8.device, "[G, M_max, N]")
    _check_out_dtype(out, out_dtype)
    if check_masked_m and g > 0:
        lo, hi = int(masked_m.min()), int(masked_m.max())
        if lo < 0 or hi > m_max:
            raise ValueError(
                f"masked_m must lie in [0, M_max = {m_max}] (valid rows of each group), got "
                f"values in [{lo}, {hi}]"
            )
    return g, m_max, n, k


def validate_k_grouped(
    a: object, b: object, ks: object, out: torch.Tensor | None, accumulate: bool
) -> tuple[int, int, list[int]]:
    """Check the arguments of any ``k_grouped_fp8_gemm_nt_contiguous`` backend.

    Returns:
        (M, N, ks as a list of ints).

    Raises:
        TypeError / ValueError: see :func:`k_grouped_fp8_gemm_nt_contiguous_ref`.
    """
    a_fp8, sf_a = _unpack("a", a)
    b_fp8, sf_b = _unpack("b", b)
    m, n, k = _check_pair_shapes(a_fp8, b_fp8)
    _check_sf("a", sf_a, (m, ceil_div(k, BLOCK)), "[M, ⌈K_total/128⌉], one per 1x128 tile")
    _check_sf("b", sf_b, (n, ceil_div(k, BLOCK)), "[N, ⌈K_total/128⌉], one per 1x128 tile")
    check_same_device(a=a_fp8, sf_a=sf_a, b=b_fp8, sf_b=sf_b)
    if isinstance(ks, torch.Tensor):
        if ks.dim() != 1 or ks.dtype.is_floating_point or ks.dtype == torch.bool:
            raise TypeError(f"ks must be a 1-D integer tensor or a list of ints, got {ks!r}")
        ks = [int(v) for v in ks.tolist()]
    elif isinstance(ks, list | tuple):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ks):
            raise TypeError(f"ks must be a list of ints (K of each group), got {ks!r}")
        ks = list(ks)
    else:
        raise TypeError(
            f"ks must be a list of ints or a 1-D integer tensor, got {type(ks).__name__}"
        )
    bad = [v for v in ks if v < 0 or v % K_GROUPED_ALIGNMENT]
    if bad:
        raise ValueError(
            f"each group's K (ks) must be a multiple of {K_GROUPED_ALIGNMENT} and >= 0 (pad each "
            f"expert's tokens with zero tokens to a multiple of {K_GROUPED_ALIGNMENT}), got {bad}"
        )
    if sum(ks) != k:
        raise ValueError(
            f"ks must sum to K_total = {k} (the columns of a and b), got sum {sum(ks)} for {ks}"
        )
    g = len(ks)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out (the fp32 [G, M, N] tensor to add into)")
    if out is not None:
        _check_grouped_out(out, (g, m, n), (torch.float32,), a_fp8.device, "[G, M, N], fp32")
    return m, n, ks


def check_one_of_ks(ks: object, ks_tensor: object) -> None:
    """ValueError unless exactly one of ``ks`` (host sizes) and ``ks_tensor`` (device sizes) is
    given to a ``k_grouped_fp8_gemm_nt_contiguous``."""
    if (ks is None) == (ks_tensor is None):
        raise ValueError("give exactly one of ks (host sizes) and ks_tensor (device sizes)")


def resolve_k_sizes(
    a: object,
    b: object,
    ks: object,
    ks_tensor: object,
    out: torch.Tensor | None,
    accumulate: bool,
) -> object:
    """For the reference: ``ks``, or the sizes of ``ks_tensor`` read back as a list (checked;
    they may sum to less than K_total).

    Raises:
        ValueError: both or neither of ``ks`` and ``ks_tensor``; ``ks_tensor`` summing to more
            than K_total or holding sizes that are negative or not multiples of 128.
    """
    check_one_of_ks(ks, ks_tensor)
    if ks_tensor is None:
        return ks
    validate_k_grouped_device(a, b, ks_tensor, out, accumulate)
    sizes = [int(v) for v in ks_tensor.tolist()]
    k_total = a[0].shape[1]
    bad = [v for v in sizes if v < 0 or v % K_GROUPED_ALIGNMENT]
    if bad or sum(sizes) > k_total:
        raise ValueError(
            f"ks_tensor must hold multiples of {K_GROUPED_ALIGNMENT}, >= 0, summing to at most "
            f"K_total = {k_total}, got {sizes}"
        )
    return sizes


def validate_k_grouped_device(
    a: object, b: object, ks_tensor: object, out: torch.Tensor | None, accumulate: bool
) -> tuple[int, int, int]:
    """Check the arguments of a ``k_grouped_fp8_gemm_nt_contiguous`` call whose group sizes are
    a device tensor (``ks=None, ks_tensor=...``) without reading its values (no host sync).

    Returns:
        (M, N, G).

    Raises:
        TypeError / ValueError: as :func:`validate_k_grouped` for the operands and ``out``;
            ``ks_tensor`` not a 1-D int32 / int64 tensor on the operands' device.
    """
    a_fp8, sf_a = _unpack("a", a)
    b_fp8, sf_b = _unpack("b", b)
    m, n, k = _check_pair_shapes(a_fp8, b_fp8)
    _check_sf("a", sf_a, (m, ceil_div(k, BLOCK)), "[M, ⌈K_total/128⌉], one per 1x128 tile")
    _check_sf("b", sf_b, (n, ceil_div(k, BLOCK)), "[N, ⌈K_total/128⌉], one per 1x128 tile")
    if not isinstance(ks_tensor, torch.Tensor):
        raise TypeError(f"ks_tensor must be a torch.Tensor, got {type(ks_tensor).__name__}")
    if ks_tensor.dim() != 1 or ks_tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"ks_tensor must be a 1-D int32 / int64 tensor (K of each group), got dtype "
            f"{ks_tensor.dtype} and shape {tuple(ks_tensor.shape)}"
        )
    check_same_device(a=a_fp8, sf_a=sf_a, b=b_fp8, sf_b=sf_b, ks_tensor=ks_tensor)
    g = ks_tensor.shape[0]
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out (the fp32 [G, M, N] tensor to add into)")
    if out is not None:
        _check_grouped_out(out, (g, m, n), (torch.float32,), a_fp8.device, "[G, M, N], fp32")
    return m, n, g


def m_grouped_fp8_gemm_nt_contiguous_ref(
    a: Operand,
    b: Operand,
    m_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    check_indices: bool = True,
) -> torch.Tensor:
    """M-grouped ``D[r] = A[r] · B[g(r)]ᵀ`` over expert-contiguous rows (MoE Fprop / Dgrad).

    Layout: the rows of each group (expert) are contiguous and padded to a multiple of
    :data:`M_GROUPED_ALIGNMENT` (128) rows; ``m_indices[r]`` is the group of row ``r`` or -1 for a
    padding row, whose output row is zeros. A is scaled per 1x128 tile, each group of B per
    128x128 block (1D2D, as :func:`fp8_gemm_nt`).

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [M_total, K] float8_e4m3fn; sf_a [M_total, ⌈K/128⌉] float32.
            M_total is a multiple of 128 (0 allowed).
        b: ``(b_fp8, sf_b)``: b_fp8 [G, N, K] float8_e4m3fn; sf_b [G, ⌈N/128⌉, ⌈K/128⌉] float32.
        m_indices: [M_total] int32, values in [-1, G); within each 128-row chunk every non-padding
            row names the same group.
        out: optional [M_total, N] bf16/fp32 output written in place (its dtype wins).
        out_dtype: torch.bfloat16 or torch.float32 when ``out`` is None.
        check_indices: check ``m_indices``' values (a host sync); backends may skip it.

    Returns:
        D [M_total, N] (``out`` itself when given). Any N and K (tails, 0) are allowed.

    Raises:
        TypeError: operands not ``(float8_e4m3fn, float32)`` pairs, ``m_indices`` not int32,
            bad ``out_dtype`` / ``out`` dtype.
        ValueError: ranks, shapes, K mismatch, devices, M_total not a multiple of 128,
            ``m_indices`` values out of range or mixing groups within a 128-row chunk.

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous``; DeepSeek-V3 report §3.3;
    docs/design.md §2.
    """
    m, n, _, g = validate_m_grouped_contiguous(a, b, m_indices, out, out_dtype, check_indices)
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if out is not None:
        out_dtype = out.dtype
    a_hp = per_token_cast_back(a_fp8, sf_a)  # [M_total, K] fp32
    d = torch.zeros((m, n), dtype=torch.float32, device=a_fp8.device)
    for grp in range(g):
        rows = (m_indices == grp).nonzero().flatten()  # [M_g]
        if rows.numel():
            b_hp = per_block_cast_back(b_fp8[grp], sf_b[grp])  # [N, K] fp32
            d[rows] = a_hp[rows] @ b_hp.t()
    return write_out(d.to(out_dtype), out)


def m_grouped_fp8_gemm_nt_masked_ref(
    a: Operand,
    b: Operand,
    masked_m: torch.Tensor,
    expected_m: int | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Masked m-grouped ``D[g, :masked_m[g]] = A[g, :masked_m[g]] · B[g]ᵀ`` (MoE decode).

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [G, M_max, K] float8_e4m3fn; sf_a [G, M_max, ⌈K/128⌉] fp32.
        b: ``(b_fp8, sf_b)``: b_fp8 [G, N, K] float8_e4m3fn; sf_b [G, ⌈N/128⌉, ⌈K/128⌉] fp32.
        masked_m: [G] int32, valid rows of each group, in [0, M_max].
        expected_m: optional hint of the typical ``masked_m`` (kernels may use it to pick tiles;
            ignored here); None or an int >= 0.
        out: optional [G, M_max, N] bf16/fp32 output (its dtype wins).
        out_dtype: torch.bfloat16 or torch.float32 when ``out`` is None.

    Returns:
        D [G, M_max, N]. Rows at or past ``masked_m[g]`` are unspecified by the contract (kernels
        leave them untouched); this reference writes zeros there.

    Raises:
        TypeError: operands not ``(float8_e4m3fn, float32)`` pairs, ``masked_m`` not int32, bad
            ``out_dtype``.
        ValueError: ranks, shapes, group counts, devices, ``expected_m`` or ``masked_m`` values
            outside [0, M_max].

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_masked``; docs/design.md §2.
    """
    g, m_max, n, _ = validate_m_grouped_masked(a, b, masked_m, expected_m, out, out_dtype)
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if out is not None:
        out_dtype = out.dtype
    d = torch.zeros((g, m_max, n), dtype=torch.float32, device=a_fp8.device)
    for grp, rows in enumerate(masked_m.tolist()):
        if rows:
            a_hp = per_token_cast_back(a_fp8[grp, :rows], sf_a[grp, :rows])  # [rows, K]
            b_hp = per_block_cast_back(b_fp8[grp], sf_b[grp])  # [N, K]
            d[grp, :rows] = a_hp @ b_hp.t()
    return write_out(d.to(out_dtype), out)


def k_grouped_fp8_gemm_nt_contiguous_ref(
    a: Operand,
    b: Operand,
    ks: list[int] | torch.Tensor | None,
    *,
    ks_tensor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """K-grouped ``D[g] (+)= A_g · B_gᵀ`` over contiguous K slices (MoE weight gradients).

    Group ``g`` owns columns ``[S_g, S_g + ks[g])`` of A and B, ``S_g = Σ_{h<g} ks[h]``. For an
    expert's ``dW_g [N_w, K_w] = dy_gᵀ · x_g``, A is ``dyᵀ`` [N_w, T] and B is ``xᵀ`` [K_w, T]
    over the permuted tokens T of all experts, both quantized 1x128 along the tokens
    (:func:`ptxtrain.quant.per_token_cast_to_fp8_t`). Padding rule: every ``ks[g]`` is a multiple
    of 128 (0 allowed), so no scale tile spans two experts; pad each expert's tokens with zero
    tokens (``ptxtrain.moe.permute_quant(..., align=128)`` does) — zero columns add nothing.

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [M, K_total] float8_e4m3fn; sf_a [M, K_total/128] float32.
        b: ``(b_fp8, sf_b)``: b_fp8 [N, K_total] float8_e4m3fn; sf_b [N, K_total/128] float32.
        ks: G ints (list, tuple or 1-D integer tensor), multiples of 128 summing to K_total; or
            None with ``ks_tensor``.
        ks_tensor: with ``ks=None``, the G sizes as a 1-D int32 / int64 tensor on the operands'
            device (DeepGEMM's name). The GPU backends read it on the device only (no host sync,
            CUDA-graph safe) and do not check its values; the sizes may then sum to less than
            K_total (columns past their sum are not read), which lets a caller size A and B from
            an upper bound known on the host. This reference reads and checks them.
        accumulate: add into ``out`` (which must be given) instead of overwriting it.

    Returns:
        D [G, M, N] float32 (``out`` itself when given); a group with ``ks[g] = 0`` gives zeros
        (or leaves ``out[g]`` unchanged when accumulating).

    Raises:
        TypeError: operands not ``(float8_e4m3fn, float32)`` pairs, ``ks`` not ints, ``out`` not
            float32.
        ValueError: ranks, shapes, devices, ``ks`` not multiples of 128 or not summing to
            K_total (``ks_tensor``: summing to more), ``accumulate=True`` without ``out``, both
            or neither of ``ks`` and ``ks_tensor``.

    Source: DeepGEMM ``k_grouped_fp8_gemm_nt_contiguous``; DeepSeek-V3 report §3.3;
    docs/design.md §2.
    """
    ks = resolve_k_sizes(a, b, ks, ks_tensor, out, accumulate)
    if ks_tensor is not None:  # only the columns the groups own
        used = sum(ks)
        a = (a[0][:, :used], a[1][:, : used // BLOCK])
        b = (b[0][:, :used], b[1][:, : used // BLOCK])
    m, n, ks = validate_k_grouped(a, b, ks, out, accumulate)
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    d = torch.zeros((len(ks), m, n), dtype=torch.float32, device=a_fp8.device)
    start = 0
    for grp, kg in enumerate(ks):
        if kg:
            cols, blocks = slice(start, start + kg), slice(start // BLOCK, (start + kg) // BLOCK)
            a_hp = per_token_cast_back(a_fp8[:, cols], sf_a[:, blocks])  # [M, K_g]
            b_hp = per_token_cast_back(b_fp8[:, cols], sf_b[:, blocks])  # [N, K_g]
            d[grp] = a_hp @ b_hp.t()
        start += kg
    return write_out(d, out, accumulate)
