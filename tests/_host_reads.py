"""Count the tensor methods that read values on the host: on a GPU each is a device sync, so a
CPU test can hold a code path to the host reads it is allowed."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch

# The Tensor methods through which Python code reads values (``int(t)``, ``if t:``,
# ``t.tolist()``, ...); torch's own C++ kernels do not go through them.
READ_METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def host_reads() -> Iterator[collections.Counter]:
    """Within the block, count calls of :data:`READ_METHODS` by name (from any thread, the
    autograd engine's included). Not thread-safe against other code patching the same methods."""
    reads: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def counted(name, fn):
        def read(self, *args, **kwargs):
            reads[name] += 1
            return fn(self, *args, **kwargs)

        return read

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield reads
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def forward_backward_reads(forward, backward) -> tuple:
    """``out = forward()`` then ``backward(out)``, counting host reads: ``(out, the forward's
    reads, the backward's reads, reads by method name)``."""
    with host_reads() as reads:
        out = forward()
        n_forward = sum(reads.values())
        backward(out)
    return out, n_forward, sum(reads.values()) - n_forward, dict(reads)
