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
- FP8 (``fp8 = True``, set through :meth:`Experts.enable_fp8` by
  :func:`ptxtrain.nn.convert_to_fp8_training`): the three projections run through
  ``ptxtrain.nn.fp8_grouped.fp8_grouped_linear`` (DeepSeek-V3's
  1x128 activation / 128x128 weight FP8 recipe, report §3.3; grouped GEMMs on GPU), with one
  padded layout per call, w1 and w3 stacked into one gate/up GEMM ``[W1[e]; W3[e]]`` (output
  ``[N, 2I]``, SwiGLU on its halves, one Dgrad GEMM with K = 2I in backward) when I is a
  multiple of 128, and each weight's quantization kept until the weight changes
  (``fp8_config.cache_weight_fp8``); bit-identical to ``fp8_grouped_linear(x, cat([w1, w3],
  1))`` -> split -> swiglu -> ``fp8_grouped_linear(h, w2)`` (three ``fp8_grouped_linear``
  calls, x quantized once for w1 and w3, when I is not a multiple of 128).

Expert parallelism: :meth:`Experts.keep_experts_` cuts the stacks down to a contiguous range of
experts in place (rank ``r`` of ``R`` keeps ``[r·E/R, (r+1)·E/R)``, the split of
:class:`ptxtrain.ep.Buffer`); ``num_experts`` stays the global count, ``num_local_experts`` and
``expert_offset`` say which ones are here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ptxtrain._checks import HP_DTYPES, check_positive_int, check_tensor
from ptxtrain.gemm.ref import M_GROUPED_ALIGNMENT
from ptxtrain.nn import fp8_grouped as fg
from ptxtrain.nn.fp8_linear import resolve_config, weight_cache_key
from ptxtrain.nn.functional import swiglu, swiglu_stacked
from ptxtrain.quant.ref import BLOCK as QUANT_BLOCK

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

    def enable_fp8(self, config) -> None:
        """Run the projections in FP8 with ``config`` (an ``Fp8LinearConfig`` or recipe name):
        the hook :func:`ptxtrain.nn.convert_to_fp8_training` calls."""
        self.fp8, self.fp8_config = True, config

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
        """The FP8 path on validated inputs: the projections through the grouped FP8 linear with
        one padded layout for the layer (one host→device copy of it, not three), w1 and w3
        stacked into one GEMM (:meth:`_swiglu_fp8`), and each weight's 128x128 quantization
        cached until the weight changes (:meth:`_quantized_weight`).
        """
        cfg = resolve_config(self.fp8_config)
        weights = (self.w1, self.w3, self.w2)
        if not cfg.any_fp8 or not (
            x.dtype in HP_DTYPES
            and all(w.dtype in HP_DTYPES and w.device == x.device for w in weights)
        ):
            # "bf16" recipe (per-expert high precision), or inputs fp8_grouped_linear rejects:
            # its public calls (and their errors).
            return self._forward_fp8_calls(x, counts, cfg)
        layout = fg.HostLayout(counts, M_GROUPED_ALIGNMENT, x.device)
        return self._swiglu_fp8(x, layout, counts, cfg)

    def _gate_up_stacks(self) -> bool:
        """Whether the FP8 path runs w1 and w3 as one stacked GEMM: I a multiple of 128, so
        every 128x128 block of ``[W1[e]; W3[e]]`` (and every 1x128 tile of ``d[h1 | h3]``) lies
        in one of the two (the stacked quantization is then W1's and W3's own)."""
        return self.w1.shape[1] % QUANT_BLOCK == 0

    def _swiglu_fp8(self, x: torch.Tensor, layout, counts, cfg) -> torch.Tensor:
        """``w2(silu(w1 x) ⊙ w3 x)`` through the grouped FP8 linear on one layout.

        w1 and w3 run stacked (DeepSeek's / Megatron's fused gate-up) where
        :meth:`_gate_up_stacks`: Fprop ``[h1 | h3] = x · [W1[e]; W3[e]]ᵀ`` ([N, 2I], one
        m-grouped GEMM), :func:`~ptxtrain.nn.functional.swiglu_stacked` on its halves, and in
        backward one quantization of ``d[h1 | h3]`` and one Dgrad GEMM with K = 2I
        (``dx = dh1·W1 + dh3·W3`` summed in fp32 inside the GEMM); Wgrad stays one k-grouped
        GEMM per weight on its rows of that quantization. Per micro-batch and MoE layer, against
        the two w1 / w3 calls: GEMM launches 9 -> 7 (Fprop and Dgrad of w1 and w3 merged, the
        K = 1408 Dgrads of the medium preset becoming one K = 2816 GEMM), quantization passes
        over activations / gradients 5 -> 4 (dh1's and dh3's become d[h1 | h3]'s), the bf16
        add of the two [N, D] Dgrad outputs gone, and with a HostLayout one gather of h and
        one scatter and one gather in backward fewer. The weight cache quantizes the stacked
        weight once per weight change (2 passes instead of 3, after one copy of w1 and w3 into
        a transient ``[E, 2I, D]`` stack). The SwiGLU keeps its input for backward in FP8
        (``config.save_swiglu_input_fp8``). Bit for bit ``fp8_grouped_linear(x, cat([w1, w3],
        1))`` -> ``swiglu_stacked`` (the same ``save_input_fp8``) -> ``fp8_grouped_linear(h,
        w2)``.

        Otherwise (I not a multiple of 128) three calls, x's quantization shared by w1 and w3.
        """
        run = fg.fp8_grouped_apply
        q = self._quantized_weight
        if self._gate_up_stacks():
            h = run(x, (self.w1, self.w3), layout, counts, cfg, q(("w1", "w3"), cfg))
            fp8_saved = cfg.save_swiglu_input_fp8 and cfg.any_fp8
            # [N, 2I] -> [N, I]; backward keeps [h1 | h3] in FP8 (the recipe's storage)
            h = swiglu_stacked(h, save_input_fp8=fp8_saved, pow2_scale=cfg.pow2_scale)
            return run(h, self.w2, layout, counts, cfg, q(("w2",), cfg))  # [N, D]
        # x's quantization for w1 and w3 (same values, same tiles): made once. Which parts are
        # needed follows the Function's rule (fprop: 1x128; wgrad of a weight that wants grad:
        # 128x1); anything missing is made inside the call.
        grad = torch.is_grad_enabled()
        want_t = cfg.wgrad and grad and self.w1.requires_grad and self.w3.requires_grad
        with torch.no_grad():
            x_q = fg.quantize_grouped_input(
                fg.autocast_input(x).detach(), layout, cfg.pow2_scale, cfg.fprop, want_t
            )
        h = run(x, self.w1, layout, counts, cfg, q(("w1",), cfg), x_q)
        h = swiglu(h, run(x, self.w3, layout, counts, cfg, q(("w3",), cfg), x_q))
        return run(h, self.w2, layout, counts, cfg, q(("w2",), cfg))  # [N, D]

    def _forward_fp8_calls(self, x, counts, cfg) -> torch.Tensor:
        h = fg.fp8_grouped_linear(x, self.w1, counts, config=cfg)  # [N, I]
        h = swiglu(h, fg.fp8_grouped_linear(x, self.w3, counts, config=cfg))
        return fg.fp8_grouped_linear(h, self.w2, counts, config=cfg)  # [N, D]

    def _quantized_weight(self, names: tuple[str, ...], cfg) -> tuple | None:
        """``(w_fp8, sf, wt_fp8, sf_t)`` of the parameters ``names`` stacked along N
        (:func:`ptxtrain.nn.fp8_grouped.stack_weights`; ``("w1", "w3")`` -> ``[E, 2I, D]``):
        each expert's 128x128 blocks of W[e] and of W[e]ᵀ (None, None without dgrad), kept
        while every one of the weights is unchanged so the micro-batches of one step quantize
        them once (None: ``cfg.cache_weight_fp8`` is off).

        The key is :func:`ptxtrain.nn.fp8_linear.weight_cache_key`'s of each weight (as for
        :class:`ptxtrain.nn.Fp8Linear`); a changed key requantizes. The entry holds aliases of
        the weights' storage, so a storage swapped in later (``w.data = ...``,
        :meth:`keep_experts_`) cannot reuse its address.
        """
        weights = [getattr(self, n).detach() for n in names]
        key = tuple(weight_cache_key(w, cfg) for w in weights)
        if any(k is None for k in key):
            return None
        cache = self.__dict__.setdefault("_fp8_weight_cache", {})
        hit = cache.get(names)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            stacked = fg.stack_weights(weights)
            q = fg.quantize_grouped_weight(stacked, True, cfg.dgrad, cfg.pow2_scale)
        cache[names] = (key, q, weights)  # the aliases keep the storage (and addresses) alive
        return q

    def fp8_grouped_gemms(self, rows: int, cfg) -> list[tuple[torch.Tensor, int, object]]:
        """The FP8 grouped linears one forward / backward on ``rows`` padded rows runs, as
        ``[(weight, rows, config), ...]`` for :func:`ptxtrain.nn.prewarm.fp8_kernels`: the
        stacked gate/up weight (a meta ``[E, 2I, D]`` tensor: its Fprop and Dgrad) and w1 and
        w3 (their k-grouped Wgrads) where :meth:`_gate_up_stacks`, else w1 and w3; then w2.
        ``cfg`` is the resolved :class:`~ptxtrain.nn.Fp8LinearConfig`."""
        if not self._gate_up_stacks():
            return [(w, rows, cfg) for w in (self.w1, self.w3, self.w2)]
        e, i, d = self.w1.shape
        stacked = torch.empty(e, 2 * i, d, dtype=self.w1.dtype, device="meta")
        wgrad_only = dataclasses.replace(cfg, fprop=False, dgrad=False)
        return [
            (stacked, rows, dataclasses.replace(cfg, wgrad=False)),
            (self.w1, rows, wgrad_only),
            (self.w3, rows, wgrad_only),
            (self.w2, rows, cfg),
        ]

    def forward_layout(self, x_pad: torch.Tensor, layout) -> torch.Tensor:
        """Apply every local expert to its rows of a padded layout, with no host sync.

        Args:
            x_pad: ``[R, D]`` float rows in ``layout`` (expert ``e``'s tokens in its rows, zero
                padding rows), e.g. from :func:`ptxtrain.moe.grouped_layout.scatter_to_layout`.
            layout: a :class:`~ptxtrain.moe.grouped_layout.GroupedLayout` over this module's
                ``num_local_experts`` experts; ``align`` a multiple of 128 on the FP8 path.

        Returns:
            ``[R, D]``: each expert's output on its rows. Padding rows hold zeros on the FP8 path
            and on the host loop; past the last expert's rows the BF16 grouped GEMM leaves them
            unspecified (the combine never reads them, and their gradient is zero).

        How: FP8 — the grouped FP8 GEMMs on the layout (m-grouped Fprop / Dgrad by
        ``m_indices``, k-grouped Wgrad by ``sizes``, read on the device). BF16 on CUDA —
        ``torch._grouped_mm`` with ``offs = layout.ends``. Otherwise (the CPU; FP32 or FP16 on
        CUDA) a host loop over the experts' slices (one read of ``sizes``).

        Raises:
            TypeError / ValueError: ``x_pad`` not ``[layout.rows, D]`` float on the weights'
                device; a layout over another expert count; FP8 with ``align % 128 != 0``.
        """
        check_tensor("x_pad", x_pad, ndim=2)
        if not x_pad.is_floating_point() or tuple(x_pad.shape) != (layout.rows, self.dim):
            raise ValueError(
                f"x_pad must be a float [R = {layout.rows}, {self.dim}] tensor, got "
                f"{x_pad.dtype} {tuple(x_pad.shape)}"
            )
        if layout.num_experts != self.num_local_experts:
            raise ValueError(
                f"layout must be over the {self.num_local_experts} local experts, got "
                f"{layout.num_experts}"
            )
        if x_pad.device != self.w1.device:
            raise ValueError(f"x_pad must be on {self.w1.device}, got {x_pad.device}")
        if self.fp8:
            if layout.align % M_GROUPED_ALIGNMENT:
                raise ValueError(
                    f"the FP8 experts need layout.align a multiple of {M_GROUPED_ALIGNMENT}, "
                    f"got {layout.align}"
                )
            return self._forward_fp8_layout(x_pad, layout)
        autocast = torch.is_autocast_enabled(x_pad.device.type)
        dtype = torch.get_autocast_dtype(x_pad.device.type) if autocast else x_pad.dtype
        if dtype == torch.bfloat16 and x_pad.is_cuda and self.w1.dtype == torch.bfloat16:
            return self._forward_grouped_mm(x_pad.to(dtype), layout)
        if x_pad.dtype != self.w1.dtype and not autocast:
            raise TypeError(
                f"x_pad must have the experts' dtype {self.w1.dtype}, got {x_pad.dtype}"
            )
        return self._forward_loop(x_pad, layout.host_sizes())

    def _forward_grouped_mm(self, x: torch.Tensor, layout) -> torch.Tensor:
        """BF16 experts through ``torch._grouped_mm`` (offsets on the device; CUDA only)."""
        offs = layout.ends
        mm = torch._grouped_mm
        h = mm(x, self.w1.transpose(1, 2), offs=offs)  # [R, I]
        h = swiglu(h, mm(x, self.w3.transpose(1, 2), offs=offs))
        return mm(h, self.w2.transpose(1, 2), offs=offs)  # [R, D]

    def _forward_loop(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Expert ``e`` on its slice of ``sizes[e]`` rows (the rest of ``x`` after the slices
        comes back as zeros): the reference path, the same ops as a ``ModuleList`` of
        ``nn.Linear`` experts."""
        # unbind once: its backward stacks the E gradients into one tensor (indexing w[e] per
        # expert would make every expert's backward materialize a full [E, ...] gradient).
        w1s, w3s, w2s = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        used = sum(sizes)
        outs = []
        for e, rows in enumerate(x[:used].split(sizes)):  # [n_e, D] each
            h = swiglu(F.linear(rows, w1s[e]), F.linear(rows, w3s[e]))  # [n_e, I]
            outs.append(F.linear(h, w2s[e]))  # [n_e, D]
        if used < x.shape[0]:
            outs.append(x.new_zeros(x.shape[0] - used, self.dim, dtype=outs[0].dtype))
        return torch.cat(outs)

    def _forward_fp8_layout(self, x_pad: torch.Tensor, layout) -> torch.Tensor:
        """:meth:`_forward_fp8` on a padded layout (no host sync)."""
        cfg = resolve_config(self.fp8_config)
        grouped = fg.DeviceLayout(layout)
        weights = (self.w1, self.w3, self.w2)
        if not cfg.any_fp8 or not (
            x_pad.dtype in HP_DTYPES
            and all(w.dtype in HP_DTYPES and w.device == x_pad.device for w in weights)
        ):
            return self._forward_loop(x_pad, layout.host_sizes())
        return self._swiglu_fp8(x_pad, grouped, None, cfg)  # [R, D]

    def forward(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """Apply expert ``e`` to its contiguous slice of rows, for every local expert.

        Args:
            x: ``[N, D]`` float rows, expert-contiguous (expert 0's rows first).
            tokens_per_expert: the ``E_local`` slice lengths, summing to ``N``: an int64
                tensor (one host sync to read it) or, where the host already knows them (an
                expert-parallel dispatch's ``num_recv_tokens_per_expert_list``), a sequence of
                ints (no sync).

        Returns:
            ``[N, D]`` in ``x``'s dtype (reference path) or the FP8 path's output dtype.

        Raises:
            TypeError: ``x`` is not floating point, ``tokens_per_expert`` not int64 (or not
                ints); (reference
                path) ``x``'s dtype (outside ``torch.autocast``) or device is not the weights'.
            ValueError: wrong shapes, or the counts are negative or do not sum to ``N``.
        """
        check_tensor("x", x, ndim=2)
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.shape[1] != self.dim:
            raise ValueError(f"x must be [N, {self.dim}], got {tuple(x.shape)}")
        if isinstance(tokens_per_expert, torch.Tensor):
            check_tensor("tokens_per_expert", tokens_per_expert, dtypes=(torch.int64,), ndim=1)
            shape = tuple(tokens_per_expert.shape)
            counts = tokens_per_expert.tolist()  # one host sync
        else:
            counts = list(tokens_per_expert)
            if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
                raise TypeError(
                    f"tokens_per_expert must be an int64 tensor or a sequence of ints, got "
                    f"{tokens_per_expert!r}"
                )
            shape = (len(counts),)
        if shape != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert must be [{self.num_local_experts}] (one count per local "
                f"expert), got {shape}"
            )
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
        return self._forward_loop(x, counts)
