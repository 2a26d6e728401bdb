"""DeepSeekMoE router with auxiliary-loss-free load balancing (DeepSeek-V3 report §2.1.2).

The routing math lives in :func:`ptxtrain.moe.ref.route_ref`; this module adds the state:

- ``weight [E, D]``: an ``nn.Parameter`` (deliberately not an ``nn.Linear``, so the FP8 swap
  never touches it; the gate GEMM runs in fp32 inside ``route_ref``).
- ``bias [E]``: the selection bias ``b``, a **persistent** fp32 buffer (part of checkpoints).
- ``expert_counts [E]``: int64 tokens routed per expert since the last :meth:`Router.update_bias`,
  a non-persistent buffer filled in training mode only.

Precision guard: a γ = 1e-3 step is below bf16's resolution near 1 (bf16 spacing at 1 is
2^-7 ≈ 7.8e-3), so the bias must stay fp32. ``Router._apply`` (the hook behind ``.to()``,
``.half()``, ``.bfloat16()``, ``.cuda()``) keeps ``bias`` fp32 *and bit-exact* whatever dtype the
rest of the model is cast to; the counters are int64, which module casts never touch.

Data parallel: each rank counts its own tokens. All-reduce (sum) ``expert_counts`` over the
data-parallel group before :meth:`update_bias` so that every rank applies the same update.
Activation recomputation runs a forward twice and doubles every count, which leaves the update
(a sign) unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ptxtrain._checks import check_tensor
from ptxtrain.moe.ref import count_per_expert, route_ref, seq_balance_loss_ref
from ptxtrain.nn.recompute import recomputing

__all__ = ["Router", "load_stats"]


def load_stats(counts: torch.Tensor) -> dict[str, float]:
    """Balance statistics of per-expert token counts ``[E]``.

    Returns ``tokens`` (routed token-slots), ``max_load_ratio`` / ``min_load_ratio`` (max / min
    count over the mean count; 1 is perfect balance) and ``cv`` (population std / mean). Ratios
    and ``cv`` are NaN when nothing was counted.
    """
    c = counts.detach().double()
    total = float(c.sum())
    if total == 0:
        nan = math.nan
        return {"tokens": 0.0, "max_load_ratio": nan, "min_load_ratio": nan, "cv": nan}
    mean = c.mean()
    return {
        "tokens": total,
        "max_load_ratio": float(c.max() / mean),
        "min_load_ratio": float(c.min() / mean),
        "cv": float(c.std(unbiased=False) / mean),
    }


class Router(nn.Module):
    """Sigmoid gate with selection-only bias and group-limited top-k.

    Args:
        dim: input width ``D``.
        n_experts: routed experts ``E``.
        top_k: experts per token ``k``.
        n_groups / n_limited_groups: group-limited routing (each token's experts come from at
            most ``n_limited_groups`` of ``n_groups`` groups of consecutive experts).
        route_scale: factor on the normalized gate weights.
        bias_update_speed: γ of :meth:`update_bias`.
        seq_aux_loss_alpha: α of the sequence-wise balance loss (0 disables it).
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        *,
        n_groups: int = 1,
        n_limited_groups: int = 1,
        route_scale: float = 1.0,
        bias_update_speed: float = 1e-3,
        seq_aux_loss_alpha: float = 0.0,
    ) -> None:
        super().__init__()
        if n_groups <= 0 or n_experts % n_groups != 0:
            raise ValueError(f"n_groups must divide n_experts={n_experts}, got {n_groups}")
        if not 0 < n_limited_groups <= n_groups:
            raise ValueError(
                f"n_limited_groups must be in [1, n_groups={n_groups}], got {n_limited_groups}"
            )
        if not 0 < top_k <= n_limited_groups * (n_experts // n_groups):
            raise ValueError(
                f"top_k must be in [1, {n_limited_groups * (n_experts // n_groups)}] "
                f"(experts reachable in n_limited_groups groups), got {top_k}"
            )
        self.dim = dim
        self.n_experts = n_experts
        self.top_k = top_k
        self.n_groups = n_groups
        self.n_limited_groups = n_limited_groups
        self.route_scale = float(route_scale)
        self.bias_update_speed = float(bias_update_speed)
        self.seq_aux_loss_alpha = float(seq_aux_loss_alpha)
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        nn.init.normal_(self.weight, std=dim**-0.5)
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32), persistent=True)
        self.register_buffer(
            "expert_counts", torch.zeros(n_experts, dtype=torch.int64), persistent=False
        )
        # The counts that drove the last update_bias: read for statistics at a logging step,
        # so that the update itself never reads a device value on the host.
        self.register_buffer(
            "last_counts", torch.zeros(n_experts, dtype=torch.int64), persistent=False
        )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, n_experts={self.n_experts}, top_k={self.top_k}, "
            f"groups={self.n_limited_groups}/{self.n_groups}, route_scale={self.route_scale}"
        )

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # Keep the selection bias fp32 and bit-exact through .to(dtype)/.half()/.bfloat16().
        old_bias = self._buffers["bias"]
        out = super()._apply(fn, recurse)
        new_bias = self._buffers["bias"]
        if new_bias is not None and new_bias.dtype != torch.float32:
            self._buffers["bias"] = old_bias.to(device=new_bias.device, dtype=torch.float32)
        return out

    def forward(
        self, x: torch.Tensor, *, seq_len: int | None = None, return_aux_loss: bool = False
    ):
        """Route ``N`` tokens.

        Args:
            x: ``[N, D]`` activations (any float dtype; routing runs in fp32, fp64 for fp64).
            seq_len: tokens per sequence ``T`` (``N = B·T``, row-major); needed only for the
                sequence-wise balance loss, ``None`` treats all ``N`` tokens as one sequence.
            return_aux_loss: also return the balance loss.

        Returns:
            ``(topk_idx [N, k] int64, topk_weights [N, k] fp32)`` (fp64 for fp64 ``x``), plus
            ``aux_loss`` (a scalar of ``topk_weights``' dtype, or ``None`` when
            ``seq_aux_loss_alpha == 0``, not training or ``N == 0``) if ``return_aux_loss``.
            In training mode the per-expert counts are accumulated.

        Raises:
            TypeError / ValueError: ``x`` is not a float ``[N, D]`` tensor; ``seq_len`` does not
                divide ``N``.
        """
        check_tensor("x", x, ndim=2)
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.shape[1] != self.dim:
            raise ValueError(f"x must be [N, {self.dim}], got {tuple(x.shape)}")
        topk_idx, topk_weights, scores = route_ref(
            x,
            self.weight,
            self.bias,
            top_k=self.top_k,
            n_groups=self.n_groups,
            n_limited_groups=self.n_limited_groups,
            route_scale=self.route_scale,
        )
        aux_loss = self.account_routing(topk_idx, scores, seq_len, aux_loss=return_aux_loss)
        if not return_aux_loss:
            return topk_idx, topk_weights
        return topk_idx, topk_weights, aux_loss

    def account_routing(
        self,
        topk_idx: torch.Tensor,
        scores: torch.Tensor,
        seq_len: int | None = None,
        *,
        aux_loss: bool = True,
    ) -> torch.Tensor | None:
        """The bookkeeping of one routing of ``N`` tokens, shared by :meth:`forward` and the fused
        kernel path (:func:`ptxtrain.moe.fused.route_fused`): in training mode, add the
        selections to ``expert_counts`` and, with ``aux_loss``, return the sequence-wise balance
        loss of ``scores``.

        Args:
            topk_idx: ``[N, k]`` int64 selected experts.
            scores: ``[N, E]`` fp32 (fp64) sigmoid affinities (differentiable; the loss's input).
            seq_len: tokens per sequence (``None`` = all ``N`` tokens are one sequence).
            aux_loss: compute the loss (False: counting only).

        Returns:
            a scalar of ``scores``' dtype, or ``None`` (not training,
            ``seq_aux_loss_alpha == 0``, ``N == 0`` or ``aux_loss`` False).

        Raises:
            ValueError: ``seq_len`` does not divide ``N`` (from the loss).
        """
        n_tokens = topk_idx.shape[0]
        if self.training and not recomputing():  # a recomputed forward counted already
            with torch.no_grad():
                self.expert_counts += count_per_expert(topk_idx, self.n_experts)  # no sync
        if not (aux_loss and self.training and self.seq_aux_loss_alpha > 0 and n_tokens > 0):
            return None
        return seq_balance_loss_ref(
            scores, topk_idx, n_tokens if seq_len is None else seq_len, self.seq_aux_loss_alpha
        )

    def load_stats(self) -> dict[str, float]:
        """Balance statistics of the counts since the last update (see :func:`load_stats`)."""
        return load_stats(self.expert_counts)

    @torch.no_grad()
    def update_bias(self, *, stats: bool = True) -> dict[str, float] | None:
        """One auxiliary-loss-free balancing step, then reset the counters.

        ``b_i += γ · sign(mean_load - load_i)``: +γ for an under-loaded expert, -γ for an
        over-loaded one, 0 when exactly at the mean (report §2.1.2, "bias update speed").
        Nothing changes when no token was counted (every load equals the mean, 0). Device ops
        only: no host sync, CUDA-graph safe. The counts are kept in ``last_counts``.

        Args:
            stats: also return :func:`load_stats` of the counts (a host read); False returns
                None (read them later with :meth:`last_load_stats`).

        Returns:
            :func:`load_stats` of the counts that drove the update, or None.
        """
        self.last_counts.copy_(self.expert_counts)
        load = self.expert_counts.double()
        self.bias += torch.sign(load.mean() - load).float() * self.bias_update_speed
        self.expert_counts.zero_()
        return self.last_load_stats() if stats else None

    def last_load_stats(self) -> dict[str, float]:
        """:func:`load_stats` of the counts of the last :meth:`update_bias` (a host read)."""
        return load_stats(self.last_counts)
