"""Direct launches of ``@triton.jit`` kernels: ``JITFunction.run``'s binder skipped after the first
launch of each specialization.

Design note. A Triton launch from Python binds and specializes every argument, hashes the
specialization and looks the compiled kernel up before it calls the compiled launcher: about
50-70 µs of host time per launch on the H200 machines (session 21, ``benchmarks.host_sections``),
more than the small GEMMs of a training step take on the GPU. :class:`DirectLauncher` keys each
launch by what that specialization depends on — each int's value, each tensor's dtype and
16-byte alignment, each ``TensorDescriptor``'s geometry, the constexprs and options — and from the
second launch of a key on calls the ``CompiledKernel``'s launcher itself with the arguments in the
kernel's parameter order, as ``JITFunction.run`` does after its lookup. The key holds what
Triton 3.6 specializes on (an int's equality to 1, divisibility by 16 and int32 / int64 /
uint64 range, only the range for ``do_not_specialize`` ints; a pointer's dtype and 16-byte
alignment) and more (constexprs and options by value, descriptors by their whole geometry), so
it never picks a kernel Triton would not; a new key goes through Triton once.

Written against Triton 3.6's ``JITFunction.run`` (``CompiledKernel.run(grid_0, grid_1, grid_2,
stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``); on other
versions, under the interpreter, or with ``PTXTRAIN_TRITON_DIRECT=0``, every launch goes through
``kernel[grid](...)`` as usual. Not covered, as with any cache of Triton kernels: a global a
kernel reads changing after its compile (Triton's own check is skipped on the direct path).
"""

from __future__ import annotations

import os

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

# The Triton releases whose launch convention this was checked against (see the note).
_VERSIONS = ("3.6.",)


def enabled() -> bool:
    """Whether :class:`DirectLauncher` may skip the binder: a checked Triton release and
    ``PTXTRAIN_TRITON_DIRECT`` not ``0``. Read at every launch (a dict lookup)."""
    return _VERSION_OK and os.environ.get("PTXTRAIN_TRITON_DIRECT", "1") != "0"


_VERSION_OK = triton.__version__.startswith(_VERSIONS)


def _int_range(v: int) -> int:
    """Triton's integer argument types: 0 int32, 1 int64, 2 uint64."""
    return 0 if -(2**31) <= v < 2**31 else (1 if v < 2**63 else 2)


def _feature(value, kind: int):
    """What Triton's specialization of one argument can depend on (see the note); ``kind``:
    0 constexpr, 1 specialized, 2 ``do_not_specialize``. None: no direct launch."""
    if kind == 0:
        return (type(value), value) if _hashable(value) else None
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None:
        return (type(value), value)
    if isinstance(value, int):
        if kind == 2:
            return (int, _int_range(value))
        return (int, value == 1, value % 16 == 0, _int_range(value))
    if isinstance(value, float):
        return (float,)
    if isinstance(value, TensorDescriptor):
        base = value.base
        return (
            "desc",
            base.dtype,
            base.data_ptr() % 16 == 0,
            tuple(value.shape),
            tuple(value.strides),
            tuple(value.block_shape),
            value.padding,
        )
    return None


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# Compiled kernels kept per launcher; past this many keys the cache starts over.
_MAX_KEYS = 1024


class DirectLauncher:
    """``launcher(grid, *args, **kwargs)`` launches ``fn[grid](*args, **kwargs)``.

    Args:
        fn: a ``@triton.jit`` function (under ``TRITON_INTERPRET=1`` every call goes through
            it unchanged).

    Call: ``grid`` a tuple of 1-3 ints; ``args`` the kernel's leading parameters, ``kwargs`` the
    rest by name (constexprs) plus launch options (``num_warps``, ``num_stages``, ...). Every
    parameter must be given (no defaults) for the direct path. Launches on the current CUDA
    device's current stream, the device of the first tensor argument (callers make it current).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.jit = isinstance(fn, triton.runtime.jit.JITFunction)
        self.names = tuple(fn.arg_names) if self.jit else ()
        # Per parameter: 0 constexpr, 1 specialized, 2 do_not_specialize (see _feature).
        self.kinds = tuple(
            0 if p.is_constexpr else (2 if p.do_not_specialize else 1)
            for p in (fn.params if self.jit else ())
        )
        self._compiled: dict[tuple, object] = {}
        self.direct_launches = 0  # launches that skipped the binder (tests read it)

    def __call__(self, grid: tuple, *args, **kwargs):
        if not (self.jit and enabled()):
            return self.fn[grid](*args, **kwargs)
        names = self.names
        n = len(args)
        values = list(args)
        options = dict(kwargs)
        for name in names[n:]:
            if name not in options:
                return self.fn[grid](*args, **kwargs)
            values.append(options.pop(name))
        feats = tuple(_feature(v, kind) for v, kind in zip(values, self.kinds))
        if None in feats:
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, feats, tuple(sorted(options.items())))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.fn[grid](*args, **kwargs)
            if hasattr(compiled, "packed_metadata") and not hasattr(compiled, "result"):
                if len(self._compiled) >= _MAX_KEYS:
                    self._compiled.clear()
                self._compiled[key] = compiled
            return compiled
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter = knobs.runtime.launch_enter_hook
        meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0],
            g1,
            g2,
            stream,
            compiled.function,
            compiled.packed_metadata,
            meta,
            enter,
            knobs.runtime.launch_exit_hook,
            *values,
        )
        self.direct_launches += 1
        return compiled


_LAUNCHERS: dict[int, DirectLauncher] = {}


def direct(fn) -> DirectLauncher:
    """The process's :class:`DirectLauncher` of ``fn`` (one per kernel, so its cache is shared by
    every call site): ``direct(kernel)(grid, *args, **kwargs)`` in place of
    ``kernel[grid](*args, **kwargs)``."""
    launcher = _LAUNCHERS.get(id(fn))
    if launcher is None or launcher.fn is not fn:
        launcher = _LAUNCHERS[id(fn)] = DirectLauncher(fn)
    return launcher
