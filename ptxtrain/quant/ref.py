"""Reference FP8 quantizers (pure PyTorch): the bit-exact oracle for every quantization kernel.

Design note. DeepSeek-V3 (report §3.3) scales activations and output gradients per 1x128 tile
(one token, 128 channels of the GEMM's K dimension) and weights per 128x128 block, online, from the
tile's absolute maximum:

    amax = max(|x_tile|) clamped below at 1e-12       (fp32)
    sf   = amax / 448                                  (fp32; 448 = E4M3's largest finite value)
    sf   = 2^ceil(log2(sf))                            (only with ``pow2_scale``)
    x_fp8 = saturate_e4m3(x / sf)                      (round to nearest even)

``sf`` is the *dequantization* factor (DeepGEMM's convention): ``x ≈ x_fp8.float() * sf``. The
division is IEEE ``x / sf`` in fp32 (correctly rounded), not a multiplication by ``1 / sf``; kernels
must match that to be bit-exact. Tails (K or M not a multiple of 128) are padded with zeros only
inside the amax computation: the FP8 outputs keep the input's shape, the scales use ceil-division.

Non-finite input: a NaN anywhere in a tile makes that tile's ``sf`` NaN, so the whole tile
dequantizes to NaN; a ±inf makes ``sf`` inf and the tile dequantizes to NaN as well. Non-finite
values therefore always surface as NaN after dequantization and are never turned into finite
numbers silently. (With power-of-two scales the same holds.)

Wgrad (``dW = dyᵀ · x``) contracts over tokens, so both its operands are quantized 1x128 along M —
128x1 tiles of the original [M, K] tensor — and stored transposed ([K, M], K-major for the NT GEMM):
that is ``per_token_cast_to_fp8_t``. ``per_token_cast_to_fp8_both`` returns both quantizations of
one tensor (a fused kernel reads it once; here it is simply both calls).
"""

from __future__ import annotations

import torch

from ptxtrain._checks import HP_DTYPES, ceil_div, check_tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Lower clamp on a tile's amax: it only keeps an all-zero tile's scale positive. It must sit far
# below any real tile's amax. Output gradients are tiny (the loss is a mean over every token of
# the step: at 65,536 tokens per step a tile's amax is ~1e-7 early in training and ~1e-9 later),
# and a clamp above the amax scales the tile into E4M3's subnormals: DeepGEMM's test-helper
# value 1e-4 leaves such a tile a few bits or none, and FP8 training then diverges from BF16.
# At 1e-12 every scale (>= 2.2e-15) and the product of two (>= 5e-30, as the GEMMs form it) is
# a normal fp32.
AMAX_EPS = 1e-12
BLOCK = 128


def check_block(block: int) -> int:
    """``block`` (a quantization tile or block edge) if it is a positive int.

    Raises:
        ValueError: ``block`` is a bool, not an int, or <= 0.
    """
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return block


# Scale layouts the quantizers can write (the functions here write row-major): ``"row"`` or
# ``"mn_major"``, strides (1, 4·⌈R/4⌉) for R rows: each column contiguous and 16-byte aligned,
# the layout the PTX (TMA) and cuBLAS GEMMs read.
SF_LAYOUTS = ("row", "mn_major")
_MN_ALIGN = 4  # fp32 scales per 16 bytes


def check_sf_layout(sf_layout: object) -> str:
    """Return ``sf_layout``; ValueError unless it is one of :data:`SF_LAYOUTS`."""
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {SF_LAYOUTS}, got {sf_layout!r}")
    return sf_layout


def _mn_stride(rows: int) -> int:
    return -(-max(rows, 1) // _MN_ALIGN) * _MN_ALIGN


def empty_sf(rows: int, cols: int, layout: str, device: torch.device) -> torch.Tensor:
    """Uninitialized fp32 scales [rows, cols] in ``layout`` (see :data:`SF_LAYOUTS`)."""
    if layout == "row":
        return torch.empty((rows, cols), dtype=torch.float32, device=device)
    stride = (1, _mn_stride(rows))
    return torch.empty_strided((rows, cols), stride, dtype=torch.float32, device=device)


def to_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """``sf`` [R, C] fp32 in the ``"mn_major"`` layout, same values; returned as is when it
    already is laid out so (and 16-byte aligned), else copied.

    Raises:
        TypeError / ValueError: ``sf`` is not a 2-D float32 tensor.
    """
    check_tensor("sf", sf, dtypes=(torch.float32,), ndim=2)
    rows, cols = sf.shape
    if sf.stride(0) == 1 and sf.stride(1) == _mn_stride(rows) and sf.data_ptr() % 16 == 0:
        return sf
    out = empty_sf(rows, cols, "mn_major", sf.device)
    out.copy_(sf)
    return out


def _check_hp_2d(name: str, x: torch.Tensor) -> torch.Tensor:
    return check_tensor(name, x, dtypes=HP_DTYPES, ndim=2)


def _scale_from_amax(amax: torch.Tensor, pow2_scale: bool) -> torch.Tensor:
    """fp32 amax (any shape) → fp32 dequantization factor ``sf``."""
    amax = amax.clamp(min=AMAX_EPS)
    # Divide by a tensor, not a Python scalar: on CUDA, PyTorch turns ``tensor / scalar`` into a
    # multiplication by the scalar's reciprocal, which is 1 ulp off IEEE division for about half
    # of the inputs; tensor / tensor is IEEE on both devices.
    sf = amax / torch.full_like(amax, FP8_MAX)
    if pow2_scale:
        # Exact: frexp gives sf = mant * 2^exp with mant in [0.5, 1); the next power of two at or
        # above sf is 2^exp, or 2^(exp-1) when sf already is a power of two (mant == 0.5).
        mant, exp = torch.frexp(sf)
        exp = torch.where(mant == 0.5, exp - 1, exp)
        sf = torch.where(torch.isfinite(sf), torch.ldexp(torch.ones_like(sf), exp), sf)
    return sf


def per_token_cast_to_fp8(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to E4M3 with one scale per 1 x ``block`` tile along its last dimension.

    Args:
        x: [M, K] float32 / bfloat16 / float16, any strides. M and K may be any size, 0 included.
        block: tile width along K (128 in the DeepSeek recipe).
        pow2_scale: round each ``sf`` up to a power of two (exact rescaling; TE's default).

    Returns:
        ``(x_fp8, sf)``: x_fp8 [M, K] float8_e4m3fn, row-major; sf [M, ⌈K/block⌉] float32,
        row-major, the dequantization factor (``x ≈ x_fp8 * sf`` per tile).

    Raises:
        TypeError: ``x`` is not a float32/bfloat16/float16 tensor.
        ValueError: ``x`` is not 2-D, or ``block`` is not a positive int.

    Source: DeepSeek-V3 report §3.3 (fine-grained quantization); docs/design.md §1.
    """
    _check_hp_2d("x", x)
    check_block(block)
    m, k = x.shape
    kb = ceil_div(k, block)
    xf = x.float()
    if k % block:
        xf = torch.nn.functional.pad(xf, (0, kb * block - k))
    tiles = xf.view(m, kb, block)  # [M, Kb, block]
    sf = _scale_from_amax(tiles.abs().amax(dim=-1), pow2_scale)  # [M, Kb]
    x_fp8 = (tiles / sf.unsqueeze(-1)).to(FP8_DTYPE).view(m, kb * block)[:, :k].contiguous()
    return x_fp8, sf.contiguous()


def per_token_cast_to_fp8_t(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [M, K] with 128x1 tiles (1 x ``block`` along M) and store it transposed.

    This is the operand layout of the wgrad (1D1D) GEMM, which contracts over tokens.

    Args:
        x: [M, K] float32 / bfloat16 / float16.
        block: tile height along M.
        pow2_scale: as in :func:`per_token_cast_to_fp8`.

    Returns:
        ``(xt_fp8, sf_t)``: xt_fp8 [K, M] float8_e4m3fn, row-major (i.e. xᵀ, K-major for the NT
        GEMM); sf_t [K, ⌈M/block⌉] float32. Equal, bit for bit, to
        ``per_token_cast_to_fp8(x.t())``.

    Raises:
        TypeError / ValueError: as :func:`per_token_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 ("transposed" re-quantization in the backward pass).
    """
    _check_hp_2d("x", x)
    return per_token_cast_to_fp8(x.t(), block, pow2_scale=pow2_scale)


def per_token_cast_to_fp8_both(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both quantizations of ``x`` [M, K] that an FP8 Linear's backward needs.

    Returns:
        ``(x_fp8 [M, K], sf [M, ⌈K/block⌉], xt_fp8 [K, M], sf_t [K, ⌈M/block⌉])`` — the results of
        :func:`per_token_cast_to_fp8` and :func:`per_token_cast_to_fp8_t`.
    """
    x_fp8, sf = per_token_cast_to_fp8(x, block, pow2_scale=pow2_scale)
    xt_fp8, sf_t = per_token_cast_to_fp8_t(x, block, pow2_scale=pow2_scale)
    return x_fp8, sf, xt_fp8, sf_t


def per_block_cast_to_fp8(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight ``w`` [N, K] to E4M3 with one scale per ``block`` x ``block`` block.

    Args:
        w: [N, K] float32 / bfloat16 / float16; N and K may have tails (any size, 0 included).
        block: block edge (128 in the DeepSeek recipe).
        pow2_scale: as in :func:`per_token_cast_to_fp8`.

    Returns:
        ``(w_fp8, sf)``: w_fp8 [N, K] float8_e4m3fn, row-major; sf [⌈N/block⌉, ⌈K/block⌉] float32.
        The blocks of ``wᵀ`` are these blocks transposed: ``(w_fp8.t(), sf.t())`` is a valid
        128x128 quantization of ``wᵀ`` (used by dgrad).

    Raises:
        TypeError / ValueError: as :func:`per_token_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3; docs/design.md §1.
    """
    check_tensor("w", w, dtypes=HP_DTYPES, ndim=2)
    check_block(block)
    n, k = w.shape
    nb, kb = ceil_div(n, block), ceil_div(k, block)
    wf = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    blocks = wf.view(nb, block, kb, block)  # [Nb, bn, Kb, bk]
    sf = _scale_from_amax(blocks.abs().amax(dim=(1, 3)), pow2_scale)  # [Nb, Kb]
    w_fp8 = (blocks / sf[:, None, :, None]).to(FP8_DTYPE).view(nb * block, kb * block)
    return w_fp8[:n, :k].contiguous(), sf.contiguous()


def per_block_cast_to_fp8_both(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """128x128 quantizations of ``w`` [N, K] and of ``wᵀ`` [K, N]: what Fprop and Dgrad read.

    A block of ``wᵀ`` is a block of ``w`` transposed (same elements, same amax), so the second
    pair is the first transposed, bit for bit: ``(w_fp8.t(), sf.t())`` made contiguous, K-major
    for the Dgrad NT GEMM (B = Wᵀ).

    Returns:
        ``(w_fp8 [N, K], sf [⌈N/block⌉, ⌈K/block⌉], wt_fp8 [K, N], sf_t [⌈K/block⌉, ⌈N/block⌉])``,
        all row-major.

    Raises:
        TypeError / ValueError: as :func:`per_block_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (W is used in Fprop and, transposed, in Dgrad);
    docs/design.md §1.
    """
    w_fp8, sf = per_block_cast_to_fp8(w, block, pow2_scale=pow2_scale)
    return w_fp8, sf, w_fp8.t().contiguous(), sf.t().contiguous()


def _check_fp8_pair(name: str, x_fp8: torch.Tensor, sf: torch.Tensor) -> None:
    check_tensor(f"{name}_fp8", x_fp8, dtypes=(FP8_DTYPE,), ndim=2)
    check_tensor(f"{name}_sf", sf, dtypes=(torch.float32,), ndim=2)
    if x_fp8.device != sf.device:
        raise ValueError(
            f"{name}_fp8 and {name}_sf must be on one device, got {x_fp8.device} and {sf.device}"
        )


def per_token_cast_back(
    x_fp8: torch.Tensor, sf: torch.Tensor, block: int = BLOCK, *, out_dtype=torch.float32
) -> torch.Tensor:
    """Dequantize a 1 x ``block`` quantization: ``x[m, k] = x_fp8[m, k] * sf[m, k // block]``.

    Args:
        x_fp8: [M, K] float8_e4m3fn.
        sf: [M, ⌈K/block⌉] float32.
        out_dtype: dtype of the result (computed in fp32, then cast).

    Returns:
        [M, K] tensor of ``out_dtype``.

    Raises:
        TypeError: wrong dtypes. ValueError: wrong ranks, ``sf``'s shape does not match, or
            ``block`` is not a positive int.
    """
    _check_fp8_pair("x", x_fp8, sf)
    check_block(block)
    m, k = x_fp8.shape
    if tuple(sf.shape) != (m, ceil_div(k, block)):
        raise ValueError(
            f"x_sf must have shape {(m, ceil_div(k, block))} for x_fp8 {tuple(x_fp8.shape)} and "
            f"block {block}, got {tuple(sf.shape)}"
        )
    scale = sf.repeat_interleave(block, dim=1)[:, :k]
    return (x_fp8.float() * scale).to(out_dtype)


def per_block_cast_back(
    w_fp8: torch.Tensor, sf: torch.Tensor, block: int = BLOCK, *, out_dtype=torch.float32
) -> torch.Tensor:
    """Dequantize a ``block`` x ``block`` quantization: ``w[n, k] = w_fp8[n, k] * sf[n//b, k//b]``.

    Args:
        w_fp8: [N, K] float8_e4m3fn.
        sf: [⌈N/block⌉, ⌈K/block⌉] float32.
        out_dtype: dtype of the result.

    Returns:
        [N, K] tensor of ``out_dtype``.

    Raises:
        TypeError: wrong dtypes. ValueError: wrong ranks, ``sf``'s shape does not match, or
            ``block`` is not a positive int.
    """
    _check_fp8_pair("w", w_fp8, sf)
    check_block(block)
    n, k = w_fp8.shape
    want = (ceil_div(n, block), ceil_div(k, block))
    if tuple(sf.shape) != want:
        raise ValueError(
            f"w_sf must have shape {want} for w_fp8 {tuple(w_fp8.shape)} and block {block}, "
            f"got {tuple(sf.shape)}"
        )
    scale = sf.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return (w_fp8.float() * scale).to(out_dtype)
