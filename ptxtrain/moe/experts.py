"""The routed experts of one MoE layer as stacked SwiGLU weights (DeepSeek-V3 report §2.1.2).

``Experts`` holds the ``E`` routed experts' weights as three stacked parameters (the layout the
grouped GEMMs read): ``w1 [E, I, D]`` (gate), ``w3 [E, I, D]`` (up), ``w2 [E, D, I]`` (down);
expert ``e`` computes ``w2[e] (silu(w1[e] x) ⊙ w3[e] x)``. Its input is expert-contiguous: the
first ``tokens_per_expert[0]`` rows go to expert 0, the next ones to expert 1, and so on (the
output of :func:`ptxtrain.moe.ref.permute_ref`).

Two paths:

- reference (``fp8 = False``): one Python loop over the experts, ``F.linear`` on each slice, the
  same operations as a ``ModuleList`` of ``nn.Linear`` experts. Every expert runs, even on 0
  rows, so every weight gets a (possibly zero) gradient and optimizers / gradient reductions
  see the same parameter set every step.
- FP8 (``fp8 = True``, set by :func:`ptxtrain.model.deepseek.convert_model_to_fp8_training`):
  the three projections run through ``ptxtrain.nn.fp8_grouped.fp8_grouped_linear`` (DeepSeek-V3's
  1x128 activation / 128x128 weight FP8 recipe, report §3.3; grouped GEMMs on GPU), with one
  padded layout per call, x quantized once for w1 and w3, and each weight's quantization kept
  until the weight changes (``fp8_config.cache_weight_fp8``); bit-identical to three
  ``fp8_grouped_linear`` calls.

Expert parallelism: :meth:`Experts.keep_experts_` cuts the stacks down to a contiguous range of
experts in place (rank ``r`` of ``R`` keeps ``[r·E/R, (r+1)·E/R)``, the split of
:class:`ptxtrain.moe.Buffer`); ``num_experts`` stays the global count, ``num_local_experts`` and
``expert_offset`` say which ones are here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ptxtrain._checks import HP_DTYPES, check_positive_int, check_tensor

__all__ = ["Experts"]


def _init_like_linear_(w: torch.Tensor) -> None:
    """``nn.Linear``'s default init, one expert at a time: ``U(-1/√fan_in, 1/√fan_in)``."""
    bound = 1.0 / math.sqrt(w.shape[-1]) if w.shape[-1] > 0 else 0.0
    with torch.no_grad():
        w.uniform_(-bound, bound)


class Experts(nn.Module):
    """``E`` SwiGLU experts with stacked weights (see the module docstring).

    Args:
        num_experts: ``E``, routed experts of the layer (the global count).
        dim: model width ``D``.
        inter_dim: intermediate width ``I`` of one expert.

    Attributes:
        w1, w3: ``[E_local, I, D]`` parameters; w2: ``[E_local, D, I]``.
        fp8: run the projections in FP8 (default False).
        fp8_config: the ``Fp8LinearConfig`` (or recipe name) of the FP8 path; None = "deepseek".
        num_experts / num_local_experts / expert_offset: global count, count held here, and the
            global id of the first one held here (0 and ``E`` without expert parallelism).

    Raises:
        TypeError / ValueError: a size is not a positive int.
    """

    def __init__(self, num_experts: int, dim: int, inter_dim: int) -> None:
        super().__init__()
        check_positive_int("num_experts", num_experts)
        check_positive_int("dim", dim)
        check_positive_int("inter_dim", inter_dim)
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.expert_offset = 0
        self.dim = dim
        self.inter_dim = inter_dim
        self.fp8 = False
        self.fp8_config = None  # Fp8LinearConfig or recipe name of the FP8 path; None = deepseek
        self.w1 = nn.Parameter(torch.empty(num_experts, inter_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter_dim))
        if not self.w1.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialization for each expert's three projections."""
        for w in (self.w1, self.w3, self.w2):
            _init_like_linear_(w)

    def extra_repr(self) -> str:
        local = ""
        if self.num_local_experts != self.num_experts:
            first = self.expert_offset
            local = f", local=[{first}, {first + self.num_local_experts})"
        return (
            f"num_experts={self.num_experts}{local}, dim={self.dim}, inter_dim={self.inter_dim}, "
            f"fp8={self.fp8}"
        )

    @torch.no_grad()
    def keep_experts_(self, start: int, count: int) -> None:
        """Keep only experts ``[start, start + count)`` (of those held now), in place.

        The parameters are replaced by fresh ones holding copies of the slices (an optimizer
        must be built afterwards). ``expert_offset`` and ``num_local_experts`` follow.

        Raises:
            ValueError: the range is empty or outside ``[0, num_local_experts)``.
        """
        if not (start >= 0 and count > 0 and start + count <= self.num_local_experts):
            raise ValueError(
                f"experts [start={start}, start + count={start + count}) must be a non-empty "
                f"range inside the {self.num_local_experts} experts held"
            )
        for name in ("w1", "w3", "w2"):
            old = getattr(self, name)
            new = nn.Parameter(old[start : start + count].clone(), old.requires_grad)
            setattr(self, name, new)
        self.expert_offset += start
        self.num_local_experts = count

    def _forward_fp8(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The FP8 path on validated inputs: the three projections through the grouped FP8
        linear with one padded layout for the layer (one host→device copy of it, not three),
        x quantized once for w1 and w3, and each weight's 128x128 quantization cached until the
        weight changes (:meth:`_quantized_weight`). Bit-identical to three
        ``fp8_grouped_linear`` calls.
        """
        from ptxtrain.nn import fp8_grouped as fg

        cfg = fg._resolve_config(self.fp8_config)
        weights = (self.w1, self.w3, self.w2)
        if not cfg.any_fp8 or not (
            x.dtype in HP_DTYPES
            and all(w.dtype in HP_DTYPES and w.device == x.device for w in weights)
        ):
            # "bf16" recipe (per-expert high precision), or inputs fp8_grouped_linear rejects:
            # its public calls (and their errors).
            return self._forward_fp8_calls(x, counts, cfg)
        layout = fg._Layout(counts, fg.gemm_ref.M_GROUPED_ALIGNMENT, x.device)
        # x's quantization for w1 and w3 (same values, same tiles): made once. Which parts are
        # needed follows the Function's rule (fprop: 1x128; wgrad of a weight that wants grad:
        # 128x1); anything missing is made inside the call.
        grad = torch.is_grad_enabled()
        want_t = cfg.wgrad and grad and self.w1.requires_grad and self.w3.requires_grad
        with torch.no_grad():
            x_q = fg._quantize_input(
                fg._autocast_input(x).detach(), layout, cfg.pow2_scale, cfg.fprop, want_t
            )
        run = fg._grouped_apply
        h = F.silu(run(x, self.w1, layout, counts, cfg, self._quantized_weight("w1", cfg), x_q))
        h = h * run(x, self.w3, layout, counts, cfg, self._quantized_weight("w3", cfg), x_q)
        return run(h, self.w2, layout, counts, cfg, self._quantized_weight("w2", cfg))  # [N, D]

    def _forward_fp8_calls(self, x, counts, cfg) -> torch.Tensor:
        from ptxtrain.nn.fp8_grouped import fp8_grouped_linear

        h = F.silu(fp8_grouped_linear(x, self.w1, counts, config=cfg))  # [N, I]
        h = h * fp8_grouped_linear(x, self.w3, counts, config=cfg)
        return fp8_grouped_linear(h, self.w2, counts, config=cfg)  # [N, D]

    def _quantized_weight(self, name: str, cfg) -> tuple | None:
        """``(w_fp8, sf, wt_fp8, sf_t)`` of parameter ``name``: each expert's 128x128 blocks of
        W[e] and of W[e]ᵀ (None, None without dgrad), kept while the weight is unchanged so the
        micro-batches of one step quantize it once (None: ``cfg.cache_weight_fp8`` is off).

        The key is :func:`ptxtrain.nn.fp8_linear.weight_cache_key`'s (as for
        :class:`ptxtrain.nn.Fp8Linear`); a changed key requantizes. The entry holds an alias of
        the quantized storage, so a storage swapped in later (``w.data = ...``,
        :meth:`keep_experts_`) cannot reuse its address.
        """
        from ptxtrain.nn.fp8_linear import weight_cache_key

        w = getattr(self, name)
        key = weight_cache_key(w, cfg)
        if key is None:
            return None
        cache = self.__dict__.setdefault("_fp8_weight_cache", {})
        hit = cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        from ptxtrain.nn.fp8_grouped import _quantize_weight

        with torch.no_grad():
            q = _quantize_weight(w.detach(), True, cfg.dgrad, cfg.pow2_scale)
        cache[name] = (key, q, w.detach())  # the alias keeps the storage (and address) alive
        return q

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Apply expert ``e`` to its contiguous slice of rows, for every local expert.

        Args:
            x: ``[N, D]`` float rows, expert-contiguous (expert 0's rows first).
            tokens_per_expert: ``[E_local]`` int64 slice lengths, summing to ``N`` (one host
                sync to read them).

        Returns:
            ``[N, D]`` in ``x``'s dtype (reference path) or the FP8 path's output dtype.

        Raises:
            TypeError: ``x`` is not floating point, ``tokens_per_expert`` not int64; (reference
                path) ``x``'s dtype (outside ``torch.autocast``) or device is not the weights'.
            ValueError: wrong shapes, or the counts are negative or do not sum to ``N``.
        """
        check_tensor("x", x, ndim=2)
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.shape[1] != self.dim:
            raise ValueError(f"x must be [N, {self.dim}], got {tuple(x.shape)}")
        check_tensor("tokens_per_expert", tokens_per_expert, dtypes=(torch.int64,), ndim=1)
        if tokens_per_expert.shape[0] != self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert must be [{self.num_local_experts}] (one count per local "
                f"expert), got {tuple(tokens_per_expert.shape)}"
            )
        counts = tokens_per_expert.tolist()  # one host sync
        if min(counts) < 0 or sum(counts) != x.shape[0]:
            raise ValueError(
                f"tokens_per_expert must be >= 0 and sum to x's {x.shape[0]} rows, got {counts}"
            )
        if self.fp8:
            return self._forward_fp8(x, counts)
        autocast = torch.is_autocast_enabled(x.device.type)  # F.linear casts both: any dtype
        if (x.dtype != self.w1.dtype and not autocast) or x.device != self.w1.device:
            raise TypeError(
                f"x must have the experts' dtype {self.w1.dtype} on {self.w1.device}, got "
                f"{x.dtype} on {x.device} (cast the module or the input)"
            )
        # unbind once: its backward stacks the E gradients into one tensor, where indexing
        # w[e] per expert made every expert's backward materialize a full [E, ...] gradient
        # (measured: the small preset trained 2.6x slower on an H200).
        w1s, w3s, w2s = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        outs = []
        for e, rows in enumerate(x.split(counts)):  # [n_e, D] each
            h = F.silu(F.linear(rows, w1s[e])) * F.linear(rows, w3s[e])  # [n_e, I]
            outs.append(F.linear(h, w2s[e]))  # [n_e, D]
        return torch.cat(outs)
