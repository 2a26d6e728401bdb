"""Which decoder layers each pipeline stage holds (``ptxtrain train --pp``, ``--pp-layout``).

A *layout* is the number of decoder layers of every stage, in stage order: ``(2, 3, 3, 2)`` gives
stage 0 layers 0-1, stage 1 layers 2-4, stage 2 layers 5-7 and stage 3 layers 8-9
(:func:`layer_ranges`). Stage 0 also holds the embedding, the last stage the final norm, the
output head and the loss (and the MTP module, were it supported). The first and the last stage
may hold no decoder layer (they still hold the embedding / the head); every other stage holds at
least one, since a stage without parameters would only relay its inputs.

Where the stages go (:mod:`ptxtrain.parallel.stages`, docs/design.md §5): 1F1B puts stage ``r``
on rank ``r``; DualPipe stages ``r`` and ``PP-1-r`` on rank ``r`` (and again, mirrored, on rank
``PP-1-r``); DualPipeV stages ``r`` and ``2PP-1-r``. Under 1F1B the slowest stage paces the
pipeline; under DualPipe and DualPipeV a rank alternates F&B cells of its two stages, so the
longer cell does (:meth:`PartCosts.bottleneck`): the two stages of a rank should be even, not
only their sum.

Unless ``--pp-layout`` gives one, :func:`balanced_layout` takes the layout with the smallest
bottleneck under a cost model (:func:`part_costs`), then among those the smallest maximum rank
cost. Both are exact minima over every contiguous layout (a dynamic program that peels stage
pairs from both ends inwards), not heuristics.

Cost model, per micro-batch, forward and backward, in FLOP-equivalents: ``tokens x FLOPs per
token + flops_per_byte x bytes``. The FLOPs are MFU's (:func:`~ptxtrain.train.mfu.
flops_per_token_by_part`: 6 per activated matmul parameter and token plus causal attention), so
a dense layer, an MoE layer (MLA + the router + ``n_activated_experts`` routed experts + the
shared experts), the head and the loss are priced by what they compute. The bytes are a
memory-bound term the FLOPs miss: every parameter of a part is read in the forward and again in
the backward and its FP32 gradient accumulated once per micro-batch (``PARAM_BYTES``), whether
a token uses it or not (at training batch sizes every routed expert gets tokens), and the
logits cross the memory a few times in the loss (``LOGIT_BYTES`` per token and vocabulary
entry); this is what makes an MoE layer, whose routed experts are mostly idle for a token,
dearer than its FLOPs at small micro-batches. The two terms add, where a roofline would take
the larger: the sum overprices a part whose weight traffic hides under its GEMMs, so it ranks
the parts rather than predicting times. ``flops_per_byte=0`` keeps the FLOPs only. Not
modelled: elementwise activation traffic, MoE dispatch and its host reads, communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..model.config import DeepSeekV3Config
from ..parallel.stages import num_stages, stages_of_rank
from .mfu import flops_per_token_by_part

__all__ = [
    "H200_FLOPS_PER_BYTE",
    "LOGIT_BYTES",
    "PARAM_BYTES",
    "PartCosts",
    "balanced_layout",
    "check_layout",
    "check_stageable",
    "even_layout",
    "format_layout",
    "layer_ranges",
    "parse_layout",
    "part_costs",
    "resolve_layout",
]

# Bytes a parameter moves per micro-batch: its BF16 value read by the forward GEMM (2) and by
# the backward's dgrad (2), its FP32 gradient read and written by the wgrad accumulation (8).
PARAM_BYTES = 12
# Bytes per token and vocabulary entry in the loss: BF16 logits written (2), read and cast to
# FP32 (2 + 4), log-softmax read and written (8), its gradient (12), cast back to BF16 (4 + 2).
LOGIT_BYTES = 34
# An H200's dense BF16 peak over its memory bandwidth: 989e12 FLOP/s / 4.2e12 B/s (the measured
# HBM copy, docs/design.md §6), the FLOPs that cost as much time as one byte moved.
H200_FLOPS_PER_BYTE = 235.0

_INF = float("inf")


@dataclass(frozen=True)
class PartCosts:
    """Modelled cost of one micro-batch, forward and backward, through each part of the model
    (FLOP-equivalents, :func:`part_costs`).

    ``embed``: the embedding (stage 0); ``layers[i]``: decoder layer ``i``; ``head``: the final
    norm, the output head and the loss, with the MTP module when the model has one (last stage).
    """

    embed: float
    layers: tuple[float, ...]
    head: float

    @property
    def total(self) -> float:
        """The cost of the whole model."""
        return self.embed + sum(self.layers) + self.head

    def stage_costs(self, layout: Sequence[int]) -> list[float]:
        """The cost of every stage of ``layout`` (checked as :func:`check_layout`)."""
        ranges = layer_ranges(check_layout(layout, len(self.layers)))
        costs = [sum(self.layers[i] for i in r) for r in ranges]
        costs[0] += self.embed
        costs[-1] += self.head
        return costs

    def rank_costs(self, layout: Sequence[int], schedule: str, pp: int) -> list[float]:
        """The cost of every pipeline rank's stages under ``schedule`` on ``pp`` ranks (a rank
        runs every micro-batch of its direction through each of its stages).

        Raises:
            ValueError: ``layout`` does not have :func:`~ptxtrain.parallel.stages.num_stages`
                counts, or is invalid (:func:`check_layout`).
        """
        stage = self.stage_costs(check_layout(layout, len(self.layers), num_stages(schedule, pp)))
        return [sum(stage[s] for s in stages_of_rank(schedule, r, pp)) for r in range(pp)]

    def bottleneck(self, layout: Sequence[int], schedule: str, pp: int) -> float:
        """What paces the pipeline's steady phase, per micro-batch (what :func:`balanced_layout`
        minimizes).

        1F1B: the largest stage cost (each rank runs one forward and one backward of its stage
        per micro-batch). DualPipe, DualPipeV: a rank of stages costing ``x`` and ``y`` runs
        F&B cells ``F_x + B_y`` and ``F_y + B_x`` in turn, each in step with its neighbours, so
        the longer of the two paces both: the largest ``2 x max(F_x + B_y, F_y + B_x)`` over the
        ranks, with ``F = 1/3`` and ``B = 2/3`` of a stage's cost (the backward does twice the
        forward's FLOPs). Equal stages give the mean rank cost, the ideal; a rank of unequal
        stages pays for the difference even when its sum is the mean.

        Raises:
            ValueError: as :meth:`rank_costs`.
        """
        stage = self.stage_costs(check_layout(layout, len(self.layers), num_stages(schedule, pp)))
        held = [[stage[s] for s in stages_of_rank(schedule, r, pp)] for r in range(pp)]
        return max(float(_cell_pair(*h)) if len(h) == 2 else h[0] for h in held)


def part_costs(
    config: DeepSeekV3Config,
    seq_len: int,
    micro_batch_tokens: int,
    *,
    ep: int = 1,
    flops_per_byte: float = H200_FLOPS_PER_BYTE,
) -> PartCosts:
    """The cost model of the module docstring for one micro-batch of ``config``.

    Args:
        config: the model.
        seq_len: tokens per sequence (the attention FLOPs grow with it).
        micro_batch_tokens: tokens of one micro-batch on one rank (``batch_size / (num_chunks x
            ep) x seq_len`` in ``ptxtrain train``).
        ep: expert-parallel ranks: each holds ``1/ep`` of the routed experts, so moves ``1/ep``
            of their parameter bytes (for the same number of expert tokens).
        flops_per_byte: FLOPs priced like one byte moved (default: an H200's); 0 = FLOPs only.

    Returns:
        :class:`PartCosts` in FLOP-equivalents.

    Raises:
        TypeError, ValueError: a bad ``config`` or ``seq_len`` (as
            :func:`~ptxtrain.train.mfu.model_flops_per_token`), ``micro_batch_tokens`` or ``ep``
            not an int >= 1, ``flops_per_byte`` negative.
    """
    from ..model.deepseek import DeepSeekV3, param_counts
    from ..moe.experts import Experts

    for name, v in (("micro_batch_tokens", micro_batch_tokens), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not flops_per_byte >= 0:
        raise ValueError(f"flops_per_byte must be >= 0, got {flops_per_byte!r}")
    flops = flops_per_token_by_part(config, seq_len)
    with torch.device("meta"):
        model = DeepSeekV3(config)

    def param_bytes(module) -> float:
        experts = [p for m in module.modules() if isinstance(m, Experts) for p in m.parameters()]
        sharded = sum(p.numel() for p in experts) * (1 - 1 / ep)  # held by the other EP ranks
        return PARAM_BYTES * (param_counts(module)[0] - sharded)

    def cost(per_token: float, nbytes: float) -> float:
        return micro_batch_tokens * per_token + flops_per_byte * nbytes

    logits = LOGIT_BYTES * micro_batch_tokens * config.vocab_size * (1 + config.mtp_depth)
    head_bytes = PARAM_BYTES * (model.norm.weight.numel() + model.head.weight.numel()) + logits
    if model.mtp is not None:
        head_bytes += param_bytes(model.mtp)
    return PartCosts(
        embed=cost(flops.embed, PARAM_BYTES * model.embed.weight.numel()),
        layers=tuple(
            cost(f, param_bytes(layer)) for f, layer in zip(flops.layers, model.layers, strict=True)
        ),
        head=cost(flops.head + flops.mtp, head_bytes),
    )


# ------------------------------------------------------------------------------------ layouts
def _min_layers(stage: int, n_stages: int) -> int:
    """Decoder layers stage ``stage`` needs: 0 for the first and last (embedding, head), else 1."""
    return 0 if stage in (0, n_stages - 1) else 1


def check_stageable(config: DeepSeekV3Config, n_stages: int) -> None:
    """Raise ``ValueError`` if a model of ``config`` cannot be cut into ``n_stages`` stages.

    Checks: no MTP module (``mtp_depth == 0``; the MTP module needs the first stage's embedding
    on the last stage), untied embeddings, and enough layers for the stages between the first
    and the last (one each).
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be an int >= 1, got {n_stages!r}")
    if n_stages > 1 and config.mtp_depth != 0:
        raise ValueError(
            "multi-token prediction (mtp_depth=1) is not supported with pipeline parallelism: "
            "the MTP module needs the first stage's embedding on the last stage; turn it off "
            "(ptxtrain train --no-mtp)"
        )
    if n_stages > 1 and config.tie_embeddings:
        raise ValueError("tie_embeddings=True is not supported with pipeline parallelism")
    need = sum(_min_layers(s, n_stages) for s in range(n_stages))
    if config.n_layers < need:
        raise ValueError(
            f"n_layers={config.n_layers} cannot be split into {n_stages} pipeline stages: the "
            f"{need} stages between the first and the last need a decoder layer each"
        )


def check_layout(layout: object, n_layers: int, n_stages: int | None = None) -> tuple[int, ...]:
    """``layout`` as a tuple of ints, checked against the model and the schedule.

    Args:
        layout: decoder layers per stage, in stage order (a non-empty list or tuple of ints).
        n_layers: the model's decoder layers; the counts must add up to it.
        n_stages: the schedule's stages (:func:`~ptxtrain.parallel.stages.num_stages`), one
            count each; None = any number.

    Raises:
        TypeError: ``layout`` is not a list or tuple of ints.
        ValueError: no count, or another number of counts than ``n_stages``; a count below 0,
            or 0 for a stage other than the first and the last; a sum other than ``n_layers``.
            The message names what it got and what it needs.
    """
    if not isinstance(layout, (list, tuple)) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in layout
    ):
        raise TypeError(f"layout must be a list or tuple of ints, got {layout!r}")
    got = format_layout(layout)
    if not layout:
        raise ValueError("layout must give at least one stage's decoder-layer count, got none")
    if n_stages is not None and len(layout) != n_stages:
        raise ValueError(
            f"layout {got} gives {len(layout)} stages, the schedule has {n_stages}: give one "
            "decoder-layer count per stage"
        )
    for s, count in enumerate(layout):
        if count < _min_layers(s, len(layout)):
            need = ">= 1 (only the first and the last stage may be empty)" if count == 0 else ">= 0"
            raise ValueError(f"layout {got}: stage {s} has {count} decoder layers, needs {need}")
    if sum(layout) != n_layers:
        raise ValueError(
            f"layout {got} sums to {sum(layout)} decoder layers, the model has n_layers={n_layers}"
        )
    return tuple(layout)


def format_layout(layout: Sequence[int]) -> str:
    """``"2,3,3,2"``: a layout as ``--pp-layout`` takes it."""
    return ",".join(str(c) for c in layout)


def parse_layout(text: str) -> tuple[int, ...]:
    """``"2,3,3,2"`` -> ``(2, 3, 3, 2)`` (``--pp-layout``; spaces around counts are allowed).

    Raises:
        ValueError: an empty text, or a part that is not a non-negative integer.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(
            f"expected decoder-layer counts per stage separated by commas, e.g. 2,3,3,2; "
            f"got {text!r}"
        )
    return tuple(int(p) for p in parts)


def even_layout(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """The decoder layers split as evenly as they go, earlier stages taking one more when
    ``n_stages`` does not divide ``n_layers`` (12 layers in 8 stages: 2,2,2,2,1,1,1,1), so the
    stage pairs of DualPipe (``r``, ``PP-1-r``) and DualPipeV (``r``, ``2PP-1-r``) hold equal
    counts.

    Raises:
        ValueError: ``n_stages`` not an int >= 1, or more stages than layers.
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be an int >= 1, got {n_stages!r}")
    if n_stages > n_layers:
        raise ValueError(
            f"n_layers={n_layers} cannot be split evenly into {n_stages} pipeline stages "
            "(n_stages must be <= n_layers)"
        )
    per, extra = divmod(n_layers, n_stages)
    return tuple(per + (s < extra) for s in range(n_stages))


def layer_ranges(layout: Sequence[int]) -> list[range]:
    """The decoder-layer indices of every stage of ``layout`` (consecutive ranges)."""
    bounds = np.concatenate(([0], np.cumsum(layout, dtype=np.int64))).tolist()
    return [range(bounds[s], bounds[s + 1]) for s in range(len(layout))]


# ------------------------------------------------------------------------- the balanced layout
def _rank_pairs(schedule: str, pp: int) -> tuple[int, bool]:
    """``(n_stages, folded)``: ``folded`` when every rank runs stages ``j`` and
    ``n_stages-1-j`` (DualPipe, DualPipeV), not when every rank runs one stage (1F1B)."""
    n = num_stages(schedule, pp)
    held = {tuple(sorted(stages_of_rank(schedule, r, pp))) for r in range(pp)}
    # the two placements the dynamic program knows (parallel.stages documents them)
    assert all(h in ((h[0],), (h[0], n - 1 - h[0])) for h in held), held
    return n, all(len(h) == 2 for h in held)


class _FoldedDP:
    """The exact min-max partition over contiguous layouts, stage pairs peeled from both ends.

    State ``(j, lo, hi)``: stages ``j .. K-1-j`` hold layers ``[lo, hi)``. Its value is the best
    (smallest) maximum of ``value(left, right)`` over the pairs ``(j', K-1-j')``, ``j' >= j``,
    where ``left`` / ``right`` are the pair's stage costs, among the layouts whose every pair has
    ``combine(left, right) <= cap``. Tables are ``(n+1) x (n+1)`` over ``(lo, hi)``, computed
    from the innermost pair out, with numpy over ``(hi, a, b)`` for each ``lo`` (``a``: where
    the left stage ends, ``b``: where the right one starts).
    """

    def __init__(self, costs: PartCosts, n_stages: int) -> None:
        self.n, self.k = len(costs.layers), n_stages
        self.prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs.layers, np.float64))))
        self.extra = np.zeros(n_stages)
        self.extra[0] += costs.embed
        self.extra[-1] += costs.head

    def run(self, value, combine, cap: float) -> tuple[float, tuple[int, ...]]:
        """``(best value, its layout)``; the value is inf when no layout keeps every pair's
        ``combine`` within ``cap``."""
        n, k, p = self.n, self.k, self.prefix
        idx = np.arange(n + 1)
        if k % 2:  # the middle stage stands alone: its cost, where it has enough layers
            m = k // 2
            table = p[None, :] - p[:, None] + self.extra[m]
            ok = idx[None, :] - idx[:, None] >= _min_layers(m, k)
            table = np.where(ok & (table <= cap), table, _INF)
        else:  # no stage left: only the empty range
            table = np.where(idx[:, None] == idx[None, :], -_INF, _INF)
        choices = []
        for j in reversed(range(k // 2)):
            table, arg = self._peel(j, table, value, combine, cap)
            choices.append(arg)
        choices.reverse()
        bounds = [0] * (k + 1)
        bounds[k] = hi = n
        lo = 0
        for j, arg in enumerate(choices):
            a, b = divmod(int(arg[lo, hi]), n + 1)
            bounds[j + 1], bounds[k - 1 - j] = a, b
            lo, hi = a, b
        return float(table[0, n]), tuple(bounds[s + 1] - bounds[s] for s in range(k))

    def _peel(self, j: int, inner, value, combine, cap):
        """The table of ``(j, lo, hi)`` from that of ``(j+1, a, b)``, and the best ``a, b``."""
        n, k, p = self.n, self.k, self.prefix
        idx = np.arange(n + 1)
        table = np.full((n + 1, n + 1), _INF)
        arg = np.zeros((n + 1, n + 1), dtype=np.int64)
        right_cost = p[:, None] - p[None, :] + self.extra[k - 1 - j]  # [hi, b]
        right_ok = idx[:, None] - idx[None, :] >= _min_layers(k - 1 - j, k)
        right_cost = np.where(right_ok, right_cost, np.nan)
        for lo in range(n + 1):
            left = p - p[lo] + self.extra[j]  # [a]
            left = np.where(idx - lo >= _min_layers(j, k), left, np.nan)
            lhs, rhs = left[None, :, None], right_cost[:, None, :]  # [hi, a, b]
            pair = combine(lhs, rhs)
            best = np.maximum(value(lhs, rhs), inner[None, :, :])
            best = np.where(pair <= cap, best, _INF)  # NaN (a stage too small) fails it too
            flat = best.reshape(n + 1, -1)
            arg[lo] = flat.argmin(axis=1)
            table[lo] = flat[idx, arg[lo]]
        return table, arg


def _cell_pair(x, y):
    """Two F&B cells of a rank holding stages of costs ``x`` and ``y``, both at the pace of the
    longer: ``F_x + B_y`` or ``F_y + B_x`` with ``F = 1/3``, ``B = 2/3`` of a stage's cost."""
    return (2.0 / 3.0) * (x + y + np.maximum(x, y))


def balanced_layout(costs: PartCosts, schedule: str, pp: int) -> tuple[int, ...]:
    """The layout with the smallest :meth:`PartCosts.bottleneck`, then (DualPipe, DualPipeV)
    the smallest maximum rank cost among those.

    Exact over every contiguous layout whose stages hold their minimum layers (module
    docstring); ties go to the layout whose stage boundaries come first, from the ends inwards.

    Args:
        costs: the parts' costs (:func:`part_costs`).
        schedule, pp: the pipeline (:func:`~ptxtrain.parallel.stages.stages_of_rank`).

    Returns:
        Decoder layers per stage, ``num_stages(schedule, pp)`` counts.

    Raises:
        ValueError: an unknown schedule, or too few layers for the stages.
    """
    k, folded = _rank_pairs(schedule, pp)
    need = sum(_min_layers(s, k) for s in range(k))
    if len(costs.layers) < need:
        raise ValueError(
            f"{len(costs.layers)} decoder layers cannot fill the {need} stages between the "
            f"first and the last of {schedule} on {pp} ranks"
        )
    dp = _FoldedDP(costs, k)
    if not folded:  # 1F1B: the stages' maximum, peeled two at a time
        return dp.run(np.maximum, np.maximum, _INF)[1]
    best, _ = dp.run(_cell_pair, _cell_pair, _INF)
    cap = best * (1 + 1e-12)  # the same layouts again, whatever the summation order
    return dp.run(np.add, _cell_pair, cap)[1]


def resolve_layout(
    config: DeepSeekV3Config,
    schedule: str,
    pp: int,
    *,
    seq_len: int,
    micro_batch_tokens: int,
    ep: int = 1,
    layout: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The layout a pipeline run uses: ``layout`` checked (:func:`check_layout`), or
    :func:`balanced_layout` under :func:`part_costs` when it is None.

    Raises:
        ValueError: a model that cannot be cut (:func:`check_stageable`) or a bad ``layout``.
        TypeError: ``layout`` not a list or tuple of ints.
    """
    n_stages = num_stages(schedule, pp)
    check_stageable(config, n_stages)
    if layout is not None:
        return check_layout(layout, config.n_layers, n_stages)
    costs = part_costs(config, seq_len, micro_batch_tokens, ep=ep)
    return balanced_layout(costs, schedule, pp)
