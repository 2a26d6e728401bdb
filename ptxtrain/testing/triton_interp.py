"""Test-only patch of Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``): GPU float semantics.

The interpreter converts between floating-point types with its own bit arithmetic, which differs
from the GPU (docs/design.md §7): float→fp8 rounds half away from zero and neither saturates nor
keeps NaN (500 → 256 instead of 448), float32→bfloat16 truncates instead of rounding to nearest
even, a ``tl.dot`` on bfloat16 operands multiplies their raw bits as integers, and ``tl.fma`` rounds
twice. Kernels checked bit for bit against a PyTorch reference need the GPU's semantics, which
torch's CPU casts have (RNE, saturating to ±448 for ``float8_e4m3fn``, NaN kept).

:func:`apply_interpreter_patch` replaces four methods of
``triton.runtime.interpreter.InterpreterBuilder`` at run time (site-packages is never edited):

- ``create_fp_to_fp`` (every cast to or from an fp8 type) and ``cast_impl`` (behind
  ``create_fp_ext`` / ``create_fp_trunc``, i.e. float32↔bfloat16↔float16↔float64) go through
  ``torch.Tensor.to`` when both types are among float64/32/16, bfloat16 and float8e4nv (torch's
  ``float8_e4m3fn``) and the rounding is round-to-nearest-even; anything else (other fp8 formats,
  whose torch CPU casts do not saturate like the GPU, or round-toward-zero) keeps the original code.
- ``create_dot`` upcasts bfloat16 and float8e4nv operands to float32 through torch before the
  matmul (products of such values are exact in float32; only the summation order can differ
  from the tensor cores).
- ``create_fma`` on float32 rounds once, like the GPU's ``fma.rn.f32`` (the interpreter computes
  ``x·y + z`` with two roundings), so kernels that rely on an exact FMA residual match.

Only tests import this module. It pins Triton 3.6.x, the version whose interpreter internals it
was written against, and refuses any other with a ``RuntimeError``.
"""

from __future__ import annotations

import numpy as np
import torch

_SUPPORTED_TRITON = (3, 6)
_MARK = "_ptxtrain_interp_patch"  # attribute set on each replacement method
_PATCHED = ("cast_impl", "create_fp_to_fp", "create_dot", "create_fma")


def _triton_version() -> tuple[int, ...]:
    import triton

    parts = []
    for piece in triton.__version__.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _check_version() -> None:
    version = _triton_version()
    if version[:2] != _SUPPORTED_TRITON:
        want = ".".join(map(str, _SUPPORTED_TRITON))
        raise RuntimeError(
            f"ptxtrain's Triton interpreter patch was written for Triton {want}.x, found "
            f"{'.'.join(map(str, version))}; check triton/runtime/interpreter.py of this version "
            "and update ptxtrain/testing/triton_interp.py"
        )


def _torch_dtype_table() -> dict:
    import triton.language as tl

    return {
        tl.float64: torch.float64,
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
    }


# How each torch dtype is held in numpy: IEEE types natively, the others as raw bits of the same
# width (the interpreter stores bfloat16 as uint16 and fp8 as uint8).
_NP_NATIVE = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}
_BITS_AS = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16)}


def _to_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Interpreter storage (a numpy array) → torch tensor of ``dtype`` holding the same values."""
    arr = np.ascontiguousarray(np.asarray(data))
    if dtype in _NP_NATIVE:
        return torch.from_numpy(arr.astype(_NP_NATIVE[dtype], copy=False))
    np_int, _ = _BITS_AS[torch.finfo(dtype).bits]
    return torch.from_numpy(arr.view(np_int)).view(dtype)


def _from_torch(t: torch.Tensor, np_storage: np.dtype) -> np.ndarray:
    """torch tensor → interpreter storage of numpy dtype ``np_storage`` (same bytes)."""
    if t.dtype in _NP_NATIVE:
        return t.numpy().view(np_storage)
    _, torch_int = _BITS_AS[torch.finfo(t.dtype).bits]
    return t.view(torch_int).numpy().view(np_storage)


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 ``a·b + c`` (the GPU's ``fma.rn.f32``), computed in float64.

    ``a·b`` is exact in float64 (48 significant bits); the sum is rounded to odd there (its
    TwoSum error decides the sticky bit) and then to float32, which is exact rounding because
    float64 carries more than 24 + 2 bits (round-to-odd theorem). Signed zeros follow IEEE.
    """
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)  # s + err == p + c exactly (TwoSum)
        inexact = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        toward = np.where(err > 0, np.inf, -np.inf)
        s = np.where(inexact, np.nextafter(s, toward), s)
    return s.astype(np.float32)


def apply_interpreter_patch() -> None:
    """Make the Triton interpreter's float casts, low-precision dots and fp32 FMAs exact.

    Idempotent: a second call changes nothing. Has an effect only on kernels run by the
    interpreter (``TRITON_INTERPRET=1`` set before they were decorated); compiled GPU kernels are
    untouched.

    Raises:
        RuntimeError: the installed Triton is not 3.6.x.
        ImportError: Triton is not installed.
    """
    _check_version()
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    if patch_applied():
        return
    import triton.language as tl

    table = _torch_dtype_table()
    rtne = interp._ir.ROUNDING_MODE.RTNE
    orig_cast_impl = builder_cls.cast_impl
    orig_fp_to_fp = builder_cls.create_fp_to_fp
    orig_dot = builder_cls.create_dot
    orig_fma = builder_cls.create_fma

    def torch_cast(src, dst_type):
        src_t = table[src.dtype.scalar]
        dst_t = table[dst_type.scalar]
        out = _to_torch(src.data, src_t).to(dst_t)
        data = _from_torch(out, interp._get_np_dtype(dst_type)).reshape(np.shape(src.data))
        return interp.TensorHandle(data, dst_type.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar in table and dst_type.scalar in table:
            return torch_cast(src, dst_type)
        return orig_cast_impl(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        downcast = dst_type.scalar.primitive_bitwidth < src.dtype.scalar.primitive_bitwidth
        exact_mode = rounding_mode == rtne or not downcast
        if exact_mode and src.dtype.scalar in table and dst_type.scalar in table:
            return torch_cast(src, dst_type)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        low = {tl_t for tl_t, t in table.items() if t in (torch.bfloat16, torch.float8_e4m3fn)}
        if a.dtype.scalar in low or b.dtype.scalar in low:
            a32 = _to_torch(a.data, table[a.dtype.scalar]).float().numpy()
            b32 = _to_torch(b.data, table[b.dtype.scalar]).float().numpy()
            out = np.matmul(a32, b32, dtype=d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def create_fma(self, x, y, z):
        if z.dtype.scalar == tl.float32:
            return interp.TensorHandle(_fma_f32(x.data, y.data, z.data), z.dtype.scalar)
        return orig_fma(self, x, y, z)

    for name, fn in (
        ("cast_impl", cast_impl),
        ("create_fp_to_fp", create_fp_to_fp),
        ("create_dot", create_dot),
        ("create_fma", create_fma),
    ):
        setattr(fn, _MARK, True)
        setattr(builder_cls, name, fn)


def patch_applied() -> bool:
    """Whether :func:`apply_interpreter_patch` is in effect (False where Triton is missing)."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder_cls = interp.InterpreterBuilder
    return all(getattr(getattr(builder_cls, name), _MARK, False) for name in _PATCHED)
