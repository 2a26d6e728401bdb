"""Tuning knobs of :class:`ptxtrain.ep.Buffer`'s communication kernels, in DeepEP's ``Config`` role.

DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
...)`` sizes the chunks of its ring-buffered intranode kernels. ptxtrain's NVLink kernel has no
ring buffer (each peer owns a region large enough for a whole operation, see
:mod:`ptxtrain.ep.nvlink`), so the knobs here are the ones it does have: the SMs, threads per
block, loads in flight, the variant and the sender split. Only ``num_sms`` is positional, so a
DeepEP-style ``Config(24, 6, 256)`` raises TypeError instead of setting an unrelated knob.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptxtrain._checks import check_positive_int
from ptxtrain.ep.nvlink import (
    DEFAULT_PIPELINE,
    DEFAULT_ROUND_ROWS,
    DEFAULT_SEND_SMS,
    DEFAULT_THREADS,
    DEFAULT_UNROLL,
    check_knobs,
    check_round_rows,
    check_send_sms,
)

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """The communication kernels' tuning knobs (validated at construction; frozen, comparable).

    Args:
        num_sms: thread blocks (one per SM) of the nvlink kernel, at most the device's SM count
            (checked when an ``"nvlink"`` Buffer is built). DeepEP's README uses 24.
        nvl_threads: threads per block, a multiple of 32 in ``[32, 1024]``.
        nvl_unroll: 16-byte loads in flight per lane, one of ``(1, 2, 4, 8)``.
        nvl_pipeline: the per-block-flag pipelined variant (bool).
        nvl_send_sms: the split variant's sender SMs out of ``num_sms`` (the rest copy out):
            ``None`` (default) half of them, or no split with ``nvl_pipeline=False``; 0 no split
            (``nvl_pipeline`` picks the variant); else in ``[1, num_sms - 1]``.
        nvl_round_rows: the split variant's rows per sender warp between two progress releases,
            in ``[1, 64]``.

    The ``"all_to_all"`` backend ignores every knob (they are still validated). Every rank of a
    group must use the same config: the kernel's protocol depends on it.

    Raises:
        TypeError: a knob of the wrong type (the message names it).
        ValueError: a knob out of range (the message names it).

    Source: DeepEP ``deep_ep.Config`` (role, not fields); :func:`ptxtrain.ep.nvlink.compile_kernel`.
    """

    num_sms: int = 24
    nvl_threads: int = field(default=DEFAULT_THREADS, kw_only=True)
    nvl_unroll: int = field(default=DEFAULT_UNROLL, kw_only=True)
    nvl_pipeline: bool = field(default=DEFAULT_PIPELINE, kw_only=True)
    nvl_send_sms: int | None = field(default=DEFAULT_SEND_SMS, kw_only=True)
    nvl_round_rows: int = field(default=DEFAULT_ROUND_ROWS, kw_only=True)

    def __post_init__(self) -> None:
        check_positive_int("num_sms", self.num_sms)
        check_knobs(self.nvl_threads, self.nvl_unroll, prefix="nvl_")
        if not isinstance(self.nvl_pipeline, bool):
            raise TypeError(f"nvl_pipeline must be a bool, got {self.nvl_pipeline!r}")
        check_send_sms(self.nvl_send_sms, self.num_sms, name="nvl_send_sms")
        check_round_rows(self.nvl_round_rows, name="nvl_round_rows")
