"""Fused training ops: SwiGLU, RMSNorm and MLA's q/k assembly with RoPE (issue 33 item 8).

Design note. A training step of the ``medium`` model on an H200 spends about a quarter of its
time in elementwise kernels around these three: SwiGLU's bf16 multiply and ``silu`` backward,
RMSNorm's fp32 casts and layer-norm kernels, RoPE's complex64 casts and MLA's ``torch.cat`` of
the nope and rope parts. Each op here is one :class:`torch.autograd.Function` over Triton kernels
(:mod:`ptxtrain.nn.triton_ops`: one forward kernel, one backward kernel, fp32 math in registers)
with a torch reference beside it:

- :func:`swiglu` ``silu(a)·b``: saves ``a`` and ``b`` (not the product); backward writes ``da`` and
  ``db`` in one pass. :func:`swiglu_stacked` takes ``a`` and ``b`` as the halves of one
  ``[..., 2I]`` tensor and writes ``[da | db]`` as one gradient (the MoE experts' fused w1/w3).
- :func:`rms_norm` ``x·rsqrt(mean(x²) + eps)·w``: saves ``x`` and the fp32 ``rstd`` per row;
  ``dweight`` is a deterministic two-step fp32 reduction (per-program partials, then a sum).
- :func:`mla_qk`: ``q_rot`` (nope copied, rope rotated) and ``k`` (each head's ``k_nope`` from
  ``kv``, the token's one rotated ``k_pe`` on every head) in one kernel; ``v`` stays a view of
  ``kv``, and the backward writes ``dkv = [dk_nope | dv]`` at once (no concatenation of the two
  gradients), ``dq``, and ``dk_pe`` (the heads summed in fp32, then rotated back once).

Which path runs (``kernels``, as ``MoE.kernels`` in :mod:`ptxtrain.moe.fused`): ``"auto"``
(default) runs the kernels for CUDA tensors of float32 / bfloat16 / float16 where Triton is
installed, and the reference otherwise (the CPU, float64); ``"ref"`` always the reference;
``"triton"`` always the kernels (on the CPU only under ``TRITON_INTERPRET=1``, for tests). The
references are the model's previous code (fp32 math, fp64 for float64 inputs, one cast back), so
CPU runs are unchanged bit for bit in float32 / float64; SwiGLU's reference computes in fp32 and
rounds once (the unfused bf16 code rounded ``silu(a)`` to bf16 first). The kernels match the
references to fp32 rounding (a different ``exp`` and reduction order; see
:mod:`ptxtrain.nn.triton_ops`), i.e. bitwise or one ulp of the output dtype. Nothing reads a
device value on the host: the CUDA path can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptxtrain._backend import KERNEL_CHOICES, use_triton_kernels
from ptxtrain._checks import HP_DTYPES, check_same_device, check_tensor

__all__ = [
    "KERNEL_CHOICES",
    "apply_rope_ref",
    "mla_qk",
    "mla_qk_ref",
    "rms_norm",
    "rms_norm_ref",
    "swiglu",
    "swiglu_ref",
    "use_triton_kernels",
]

_FLOAT_DTYPES = (*HP_DTYPES, torch.float64)


def _ops():
    from ptxtrain.nn import triton_ops

    return triton_ops


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The math dtype of a reference: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _check_float(name: str, t: object) -> torch.Tensor:
    return check_tensor(name, t, dtypes=_FLOAT_DTYPES)


# ------------------------------------------------------------------------------------ SwiGLU
def swiglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a)·b`` in fp32 (fp64 for float64), one cast to ``a``'s dtype (autograd by torch)."""
    acc = _acc(a.dtype)
    return (F.silu(a.to(acc)) * b.to(acc)).to(a.dtype)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return _ops().swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return _ops().swiglu_bwd(grad.contiguous(), a, b)


def swiglu(a: torch.Tensor, b: torch.Tensor, *, kernels: str = "auto") -> torch.Tensor:
    """SwiGLU's gate ``silu(a) ⊙ b`` (the MLP's ``silu(w1 x) ⊙ w3 x``, DeepSeek-V3 report §2.1.2).

    Args:
        a: gate pre-activation, any shape, float32 / bfloat16 / float16 (float64: reference).
        b: up projection, ``a``'s shape, dtype and device.
        kernels: see :func:`ptxtrain._backend.use_triton_kernels`.

    Returns:
        ``a``'s shape and dtype; fp32 math (fp64 for float64), one rounding.

    Raises:
        TypeError: ``a`` / ``b`` not float tensors, or of different dtypes.
        ValueError: different shapes or devices; a bad ``kernels``.
    """
    a, b = _check_float("a", a), _check_float("b", b)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if b.shape != a.shape:
        raise ValueError(f"b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
    check_same_device(a=a, b=b)
    if use_triton_kernels(kernels, a):
        return _SwiGLUFn.apply(a, b)
    return swiglu_ref(a, b)


def swiglu_stacked_ref(h: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_ref` of ``h``'s two halves along the last dim (autograd by torch: the
    halves' gradients land in one ``h``-shaped tensor)."""
    return swiglu_ref(*h.chunk(2, dim=-1))


class _SwiGLUStackedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        rows = h.reshape(-1, h.shape[-1]).contiguous()
        ctx.save_for_backward(rows)
        ctx.shape = h.shape
        return _ops().swiglu_stacked_fwd(rows).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        # The width is explicit: an expert shard that received no rows has 0 of them, and
        # reshape cannot infer a -1 next to a 0.
        g = grad.reshape(rows.shape[0], rows.shape[1] // 2).contiguous()
        return _ops().swiglu_stacked_bwd(g, rows).view(ctx.shape)


class _SwiGLUStackedFp8Fn(torch.autograd.Function):
    """The stacked SwiGLU keeping its input for backward as the 1x128 FP8 quantization (Triton
    kernels ``swiglu_stacked_fwd_q`` / ``bwd_q``)."""

    @staticmethod
    def forward(ctx, h, pow2_scale):
        rows = h.reshape(-1, h.shape[-1]).contiguous()
        y, q, sf = _ops().swiglu_stacked_fwd_q(rows, pow2_scale)
        ctx.save_for_backward(q, sf)
        ctx.shape, ctx.dtype = h.shape, h.dtype
        return y.view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad):
        q, sf = ctx.saved_tensors
        g = grad.reshape(q.shape[0], q.shape[1] // 2).contiguous()
        return _ops().swiglu_stacked_bwd_q(g, q, sf, ctx.dtype).view(ctx.shape), None


class _SwiGLUStackedFp8RefFn(torch.autograd.Function):
    """The reference of :class:`_SwiGLUStackedFp8Fn`: forward :func:`swiglu_stacked_ref`, and
    backward torch's autograd of :func:`swiglu_ref` at the dequantized input (fp32)."""

    @staticmethod
    def forward(ctx, h, pow2_scale):
        from ptxtrain.quant import ref as qref

        rows = h.detach().reshape(-1, h.shape[-1])
        ctx.save_for_backward(*qref.per_token_cast_to_fp8(rows, pow2_scale=pow2_scale))
        ctx.shape, ctx.dtype = h.shape, h.dtype
        return swiglu_stacked_ref(h.detach())

    @staticmethod
    def backward(ctx, grad):
        from ptxtrain.quant import ref as qref

        q, sf = ctx.saved_tensors
        with torch.enable_grad():
            h = qref.per_token_cast_back(q, sf).requires_grad_()
            y = swiglu_ref(*h.chunk(2, dim=-1))
            (dh,) = torch.autograd.grad(y, h, grad.reshape(y.shape).float())
        return dh.to(ctx.dtype).view(ctx.shape), None


def swiglu_stacked(
    h: torch.Tensor,
    *,
    kernels: str = "auto",
    save_input_fp8: bool = False,
    pow2_scale: bool = False,
) -> torch.Tensor:
    """SwiGLU of a stacked gate/up projection: ``silu(h[..., :I]) ⊙ h[..., I:]``.

    The experts' fused w1/w3 GEMM writes ``[w1 x | w3 x]`` as one ``[..., 2I]`` tensor
    (:class:`ptxtrain.moe.Experts`); this reads its halves in place and, in backward, writes
    ``[d(w1 x) | d(w3 x)]`` as one ``[..., 2I]`` gradient (the layout the stacked dgrad GEMM
    reads), where :func:`swiglu` on the two slices would copy them and leave the gradient's
    concatenation to autograd. Bit for bit ``swiglu(h[..., :I], h[..., I:], kernels=kernels)``
    (the same math on both paths: the Triton kernels share it, the reference is that call).

    With ``save_input_fp8`` (DeepSeek-V3 report §3.3, low-precision storage: the SwiGLU input
    of the MoE experts is cached in FP8) backward keeps ``h``'s 1x128 quantization (e4m3 and
    fp32 scales, ``per_token_cast_to_fp8``'s bits) instead of ``h``, about half its bytes, and
    computes the gradient at the dequantized values; the forward output is unchanged.

    Args:
        h: ``[..., 2I]`` float32 / bfloat16 / float16 (float64: reference), ``2I`` even and > 0.
        kernels: see :func:`ptxtrain._backend.use_triton_kernels`.
        save_input_fp8: keep ``h`` for backward in FP8 (needs ``I`` a multiple of 128, so no
            1x128 tile spans the two halves; not for float64).
        pow2_scale: with ``save_input_fp8``, round the scales up to powers of two.

    Returns:
        ``[..., I]`` in ``h``'s dtype; fp32 math (fp64 for float64), one rounding.

    Raises:
        TypeError: ``h`` not a float tensor; ``save_input_fp8`` / ``pow2_scale`` not a bool.
        ValueError: ``h`` 0-d or its last dim odd or 0; a bad ``kernels``; ``save_input_fp8``
            with ``I`` not a multiple of 128 or a float64 ``h``.

    Source: DeepSeek-V3 report §2.1.2 (SwiGLU experts); Megatron-LM's fused gate/up
    (``gated_linear_unit``) halves layout.
    """
    h = _check_float("h", h)
    if h.dim() == 0 or h.shape[-1] == 0 or h.shape[-1] % 2:
        raise ValueError(
            f"h must be [..., 2I] with an even last dim 2I > 0, got shape {tuple(h.shape)}"
        )
    for name, flag in (("save_input_fp8", save_input_fp8), ("pow2_scale", pow2_scale)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    triton = use_triton_kernels(kernels, h)
    if save_input_fp8:
        inter = h.shape[-1] // 2
        if inter % 128 or h.dtype == torch.float64:
            raise ValueError(
                f"save_input_fp8 needs h [..., 2I] with I a multiple of 128 and a float32 / "
                f"bfloat16 / float16 dtype, got shape {tuple(h.shape)} and {h.dtype}"
            )
        fn = _SwiGLUStackedFp8Fn if triton else _SwiGLUStackedFp8RefFn
        return fn.apply(h, pow2_scale)
    if triton:
        return _SwiGLUStackedFn.apply(h)
    return swiglu_stacked_ref(h)


# ------------------------------------------------------------------------------------ RMSNorm
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` of ``x`` and ``weight`` cast to fp32 (fp64 for float64), cast back to
    ``x``'s dtype: the model's RMSNorm before the fused kernel (autograd by torch)."""
    acc = _acc(x.dtype)
    return F.rms_norm(x.to(acc), (x.shape[-1],), weight.to(acc), eps).to(x.dtype)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        w = weight.contiguous()
        y, rstd = _ops().rms_norm_fwd(rows, w, eps)
        ctx.save_for_backward(rows, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, w, rstd = ctx.saved_tensors
        g = grad.reshape(rows.shape)
        if g.stride(-1) != 1:
            g = g.contiguous()
        dx, dw = _ops().rms_norm_bwd(g, rows, w, rstd)
        return dx.view(grad.shape), dw, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, kernels: str = "auto"
) -> torch.Tensor:
    """RMSNorm ``x / sqrt(mean(x²) + eps) · weight`` over the last dim (DeepSeek-V3 report §2.1).

    Args:
        x: ``[..., D]`` float32 / bfloat16 / float16 (float64: reference); ``D`` up to
            16384 on the kernel path (``"auto"`` takes the reference beyond).
        weight: ``[D]`` float, any of those dtypes (loaded in its dtype; its gradient comes back
            in it).
        eps: added to the mean square (a float >= 0).
        kernels: see :func:`ptxtrain._backend.use_triton_kernels`.

    Returns:
        ``x``'s shape and dtype; fp32 math (fp64 for float64).

    Raises:
        TypeError: ``x`` / ``weight`` not float tensors; ``eps`` not a real number.
        ValueError: ``weight`` not ``[D]``; different devices; ``eps < 0``; ``kernels="triton"``
            with ``D > 16384``; a bad ``kernels``.
    """
    x, weight = _check_float("x", x), _check_float("weight", weight)
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must be [D] with D = x.shape[-1], got weight {tuple(weight.shape)} and x "
            f"{tuple(x.shape)}"
        )
    check_same_device(x=x, weight=weight)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    fused = use_triton_kernels(kernels, x)
    if fused and x.shape[-1] > _ops().MAX_NORM_DIM:
        if kernels == "triton":
            raise ValueError(
                f"kernels='triton' takes x.shape[-1] <= {_ops().MAX_NORM_DIM}, got {x.shape[-1]}"
            )
        fused = False
    if fused and weight.dtype in HP_DTYPES:
        return _RMSNormFn.apply(x, weight, float(eps))
    return rms_norm_ref(x, weight, eps)


# ------------------------------------------------------------------------------------ MLA q/k
def apply_rope_ref(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2j], x[2j+1])`` of ``x [B, T, H, R]`` by ``freqs [T, R/2]``
    complex64 (one complex multiply); complex64 math (complex128 for float64), ``x``'s dtype out.
    DeepSeek's reference RoPE layout (report §2.1.1)."""
    acc = _acc(x.dtype)
    xc = torch.view_as_complex(
        x.to(acc, memory_format=torch.contiguous_format).unflatten(-1, (-1, 2))
    )  # [B, T, H, R/2]
    out = torch.view_as_real(xc * freqs.to(xc.dtype)[:, None, :]).flatten(-2)  # [B, T, H, R]
    return out.to(x.dtype)


def mla_qk_ref(
    q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, freqs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mla_qk` in torch ops (concatenations and :func:`apply_rope_ref`; autograd by
    torch): the model's MLA before the fused kernel."""
    rope = k_pe.shape[-1]
    nope = q.shape[-1] - rope
    b, t, h, _ = q.shape
    q_nope, q_pe = q.split([nope, rope], dim=-1)  # [B, T, H, nope|rope]
    q_rot = torch.cat((q_nope, apply_rope_ref(q_pe, freqs)), dim=-1)
    k_pe = apply_rope_ref(k_pe.unsqueeze(2), freqs)  # [B, T, 1, rope], shared by all heads
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)  # [B, T, H, nope|v]
    k = torch.cat((k_nope, k_pe.expand(b, t, h, rope)), dim=-1)  # [B, T, H, nope+rope]
    return q_rot, k, v


class _MLAQKFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, k_pe, freqs):
        nope = q.shape[-1] - k_pe.shape[-1]
        f = torch.view_as_real(freqs)  # [T, rope/2, 2] fp32 (cos, sin): a view
        q, kv, k_pe = (z if z.stride(-1) == 1 else z.contiguous() for z in (q, kv, k_pe))
        q_rot, k = _ops().mla_qk_fwd(q, kv, k_pe, f, nope)
        ctx.save_for_backward(freqs)
        ctx.nope, ctx.pe_dtype = nope, k_pe.dtype
        return q_rot, k, kv[..., nope:]

    @staticmethod
    def backward(ctx, dq_rot, dk, dv):
        (freqs,) = ctx.saved_tensors
        dq_rot, dk, dv = (z if z.stride(-1) == 1 else z.contiguous() for z in (dq_rot, dk, dv))
        f = torch.view_as_real(freqs)
        dq, dkv, dpe = _ops().mla_qk_bwd(dq_rot, dk, dv, f, ctx.nope, ctx.pe_dtype)
        return dq, dkv, dpe, None


def _check_mla_qk(q, kv, k_pe, freqs) -> None:
    q, kv, k_pe = _check_float("q", q), _check_float("kv", kv), _check_float("k_pe", k_pe)
    freqs = check_tensor("freqs", freqs, dtypes=(torch.complex64,), ndim=2)
    check_tensor("q", q, ndim=4)
    check_tensor("kv", kv, ndim=4)
    check_tensor("k_pe", k_pe, ndim=3)
    for name, z in (("kv", kv), ("k_pe", k_pe)):
        if z.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {z.dtype}")
    b, t, h, qk = q.shape
    rope = k_pe.shape[-1]
    if rope % 2 or rope > qk or tuple(k_pe.shape[:2]) != (b, t):
        raise ValueError(
            f"k_pe must be [B, T, rope] with B, T of q {tuple(q.shape)} and an even rope <= "
            f"{qk}, got {tuple(k_pe.shape)}"
        )
    if tuple(kv.shape[:3]) != (b, t, h) or kv.shape[-1] < qk - rope:
        raise ValueError(
            f"kv must be [B, T, H, nope + v] = [{b}, {t}, {h}, >= {qk - rope}], got "
            f"{tuple(kv.shape)}"
        )
    if tuple(freqs.shape) != (t, rope // 2):
        raise ValueError(
            f"freqs must be [T, rope/2] = [{t}, {rope // 2}], got {tuple(freqs.shape)}"
        )
    check_same_device(q=q, kv=kv, k_pe=k_pe, freqs=freqs)


def mla_qk(
    q: torch.Tensor,
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    freqs: torch.Tensor,
    *,
    kernels: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's attention operands with decoupled RoPE (DeepSeek-V3 report §2.1.1, eqs. 3-5, 7-9).

    Args:
        q: ``[B, T, H, nope + rope]`` queries after the up-projection (rope part not rotated).
        kv: ``[B, T, H, nope + v]`` decompressed keys (nope part) and values, q's dtype.
        k_pe: ``[B, T, rope]`` the decoupled RoPE key, one per token (not rotated), q's dtype
            (a slice of ``wkv_a``'s output is fine).
        freqs: ``[T, rope/2]`` complex64 ``e^{i·t·θ_j}``; RoPE rotates interleaved pairs
            ``(x[2j], x[2j+1])``; no gradient flows to it.
        kernels: see :func:`ptxtrain._backend.use_triton_kernels`.

    Returns:
        ``(q_rot, k, v)``: ``q_rot`` and ``k`` ``[B, T, H, nope + rope]`` contiguous in q's dtype
        (``k[..., nope:]`` the rotated ``k_pe`` on every head); ``v = kv[..., nope:]`` a view.
        fp32 rotation (fp64 for float64 on the reference), one rounding.

    Raises:
        TypeError: non-float ``q`` / ``kv`` / ``k_pe`` or of different dtypes; ``freqs`` not
            complex64.
        ValueError: shapes that do not fit the above; different devices; a bad ``kernels``.
    """
    _check_mla_qk(q, kv, k_pe, freqs)
    if use_triton_kernels(kernels, q):
        return _MLAQKFn.apply(q, kv, k_pe, freqs)
    return mla_qk_ref(q, kv, k_pe, freqs)
