"""DeepSeekMoE layer: shared experts + fine-grained routed experts (DeepSeek-V3 report §2.1.2).

``y = shared(x) + Σ_{j<k} g_{t,j} · expert_{idx_{t,j}}(x)`` (report eq. 12), every expert a SwiGLU
MLP ``w2(silu(w1 x) ⊙ w3 x)`` of plain ``nn.Linear(bias=False)`` layers (so the FP8 swap can
replace them). The ``n_shared_experts`` shared experts are fused into one MLP of width
``n_shared_experts · moe_inter_dim`` (mathematically the same as summing them).

Single-device data path, the shape that the grouped GEMM and the expert-parallel
dispatch/combine will later replace:

1. route (``Router`` -> ``route_ref``),
2. ``permute_ref``: one stable sort of the ``N·k`` (token, slot) pairs by expert, rows gathered
   into expert-contiguous order,
3. one Python loop over the experts, each on its contiguous slice (one host sync to read the
   slice lengths; an expert with no tokens runs on 0 rows, so its gradient is zero, not None),
4. ``unpermute_ref``: weighted ``index_add`` back to token order, accumulated in **fp32**, cast to
   the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ptxtrain._checks import check_tensor
from ptxtrain.moe.ref import permute_ref, unpermute_ref
from ptxtrain.moe.router import Router

__all__ = ["MLP", "MoE"]


class MLP(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) ⊙ w3 x)``: a dense FFN, one routed expert, or the shared experts.

    ``w1`` (gate) and ``w3`` (up) are ``[inter_dim, dim]``, ``w2`` (down) is ``[dim, inter_dim]``.
    """

    def __init__(self, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim] -> [..., dim]`` in ``x``'s dtype."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Shared + routed SwiGLU experts behind a :class:`~ptxtrain.moe.Router`.

    Args:
        dim: model width ``D``.
        moe_inter_dim: intermediate width of one expert.
        n_routed_experts / n_activated_experts: ``E`` and top-``k``.
        n_shared_experts: shared experts (0 = none).
        n_groups / n_limited_groups / route_scale / bias_update_speed / seq_aux_loss_alpha:
            passed to the :class:`Router`.
    """

    def __init__(
        self,
        dim: int,
        moe_inter_dim: int,
        n_routed_experts: int,
        n_activated_experts: int,
        *,
        n_shared_experts: int = 1,
        n_groups: int = 1,
        n_limited_groups: int = 1,
        route_scale: float = 1.0,
        bias_update_speed: float = 1e-3,
        seq_aux_loss_alpha: float = 0.0,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.n_routed_experts = n_routed_experts
        self.n_activated_experts = n_activated_experts
        self.router = Router(
            dim,
            n_routed_experts,
            n_activated_experts,
            n_groups=n_groups,
            n_limited_groups=n_limited_groups,
            route_scale=route_scale,
            bias_update_speed=bias_update_speed,
            seq_aux_loss_alpha=seq_aux_loss_alpha,
        )
        self.experts = nn.ModuleList(MLP(dim, moe_inter_dim) for _ in range(n_routed_experts))
        self.shared_experts = (
            MLP(dim, n_shared_experts * moe_inter_dim) if n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor, *, return_aux_loss: bool = False):
        """Apply the layer to ``x [B, T, D]`` (or ``[N, D]``, treated as one sequence).

        Returns:
            ``y`` (same shape and dtype as ``x``), or ``(y, aux_loss)`` when ``return_aux_loss``
            (``aux_loss``: the router's sequence-wise balance loss, fp32 scalar or ``None``).

        Raises:
            TypeError / ValueError: ``x`` is not a float tensor of rank 2 or 3 with last dim ``D``.
        """
        check_tensor("x", x, ndim=(2, 3))
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dim {self.dim}, got shape {tuple(x.shape)}")
        seq_len = x.shape[1] if x.dim() == 3 else x.shape[0]
        flat = x.reshape(-1, self.dim)  # [N, D]
        topk_idx, topk_weights, aux_loss = self.router(
            flat, seq_len=seq_len, return_aux_loss=True
        )  # [N, k], [N, k], scalar | None
        y = self._routed(flat, topk_idx, topk_weights)  # [N, D]
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        y = y.view_as(x)
        return (y, aux_loss) if return_aux_loss else y

    def _routed(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed experts over expert-contiguous slices: permute, loop, weighted un-permute."""
        x_perm, sorted_slots, tokens_per_expert = permute_ref(
            x, topk_idx, self.n_routed_experts
        )  # [N·k, D], [N·k], [E]
        counts = tokens_per_expert.tolist()  # one host sync
        # Every expert runs, even on 0 rows, so every expert weight gets a (possibly zero)
        # gradient: DDP/FSDP and the optimizers then see the same parameter set each step.
        outs = [expert(rows) for expert, rows in zip(self.experts, x_perm.split(counts))]
        y_perm = torch.cat(outs)  # [N·k, D]
        return unpermute_ref(y_perm, sorted_slots, topk_weights)
