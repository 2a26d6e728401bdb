"""DeepSeekMoE layer: shared experts + fine-grained routed experts (DeepSeek-V3 report §2.1.2).

``y = shared(x) + Σ_{j<k} g_{t,j} · expert_{idx_{t,j}}(x)`` (report eq. 12), every expert a SwiGLU
MLP ``w2(silu(w1 x) ⊙ w3 x)`` of plain ``nn.Linear(bias=False)`` layers (so the FP8 swap can
replace them). The ``n_shared_experts`` shared experts are fused into one MLP of width
``n_shared_experts · moe_inter_dim`` (mathematically the same as summing them).

The routed experts are one :class:`~ptxtrain.moe.experts.Experts` module (stacked weights
``w1/w3 [E, I, D]``, ``w2 [E, D, I]``); the shared experts stay an :class:`MLP`.

Single-device data path:

1. route (``Router`` -> ``route_ref``),
2. ``permute_ref``: one stable sort of the ``N·k`` (token, slot) pairs by expert, rows gathered
   into expert-contiguous order,
3. ``Experts``: each expert on its contiguous slice (a loop of ``F.linear``, or FP8 grouped
   GEMMs; an expert with no tokens runs on 0 rows, so its gradient is zero, not None),
4. ``unpermute_ref``: weighted ``index_add`` back to token order, accumulated in **fp32**, cast to
   the activation dtype.

Kernels (``MoE.kernels``, :mod:`ptxtrain.moe.fused`): ``"auto"`` (default) runs steps 1 (after
the fp32 logits GEMM), 2 and 4 through the Triton kernels of :mod:`ptxtrain.moe.triton` for CUDA
inputs (float32 / bfloat16 / float16) and the references above otherwise (the CPU); ``"ref"``
always the references; ``"triton"`` always the kernels (on the CPU only under
``TRITON_INTERPRET=1``). Same forward values (the kernels are bitwise twins of the references
evaluated on the CPU), same gradient paths (the gates stay differentiable w.r.t. the router
input and weight, the selection does not); the backward sums run in fp32 in a fixed order.

Expert parallelism (:meth:`MoE.enable_expert_parallel`, report §3.2.2 / docs/design.md §4): with a
group of ``R`` ranks, rank ``r`` keeps experts ``[r·E/R, (r+1)·E/R)`` only. Every rank routes its
own tokens over all ``E`` experts, :meth:`ptxtrain.ep.Buffer.dispatch` sends each token once to
every rank holding one of its experts, the receiver permutes the received rows by local expert
(slots for other ranks' experts are dropped), runs its local experts, un-permutes with the received
gate weights (fp32 accumulation) and :meth:`~ptxtrain.ep.Buffer.combine` sums the partial outputs
back at the source token (fp32 accumulation). Forward and backward are collectives: every rank of
the group must run every MoE forward and backward in the same order. The router keeps counting its
own rank's tokens; all-reduce ``router.expert_counts`` over the data-parallel group before
``update_bias`` (:meth:`MoE.sync_expert_counts`, or the model's ``update_router_biases``). The
layers of a model share ONE :class:`~ptxtrain.ep.Buffer`
(:meth:`ptxtrain.model.DeepSeekV3.enable_expert_parallel` passes it to every layer): nothing of a
dispatch is kept on the buffer until its combine (the layout, cached indices and slot table live in
the call's :class:`~ptxtrain.ep.DispatchHandle`; the nvlink transport's buffer holds rows only
within one kernel launch), so layer after layer, forward and backward, may use it, provided the
calls run one at a time (one CUDA stream; not with ``PTXTRAIN_PP_OVERLAP=1`` on ``"nvlink"``).

FP8 dispatch (report §3.3): when the routed experts run in FP8 (``experts.fp8``, set by
``--precision fp8`` through :func:`ptxtrain.model.deepseek.convert_model_to_fp8_training`) and
``MoE.fp8_dispatch`` is True (the default), the tokens are quantized 1x128
(:func:`ptxtrain.quant.per_token_cast_to_fp8`) and dispatched as ``(e4m3, fp32 scales)``, a
little over half the bytes of BF16; the receiver dequantizes them to the activation dtype for
the experts, which quantize them again: 1x128 re-quantization of a dequantized row gives back
its e4m3 values (they sit on the grid up to one rounding of the dequantization) with scales
within an ulp, so Fprop sees what a local quantization gives; Wgrad's 128x1 quantization along
the tokens now rounds an already-rounded input (report §3.5 has the same step). The combine,
and the backward's combine of the dispatched rows' gradient, stay in the activation dtype (BF16
in training), the quantization counting as the identity for the gradient
(:func:`ptxtrain.moe.fused.dispatch_fp8`). Float64 tokens (which have no FP8 recipe) are
dispatched in float64. So ``ptxtrain train --ep N --precision fp8`` dispatches FP8 with no extra
flag; set ``fp8_dispatch = False`` on a layer to send BF16.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ptxtrain._checks import ceil_div, check_tensor
from ptxtrain.ep.buffer import Buffer
from ptxtrain.gemm.ref import M_GROUPED_ALIGNMENT
from ptxtrain.moe.experts import Experts
from ptxtrain.moe.fused import (
    KERNEL_CHOICES,
    dispatch_fp8,
    permute_fused,
    route_fused,
    unpermute_fused,
    use_triton_kernels,
)
from ptxtrain.moe.grouped_layout import (
    build_grouped_layout,
    combine_from_layout,
    scatter_to_layout,
)
from ptxtrain.moe.ref import permute_ref, unpermute_ref
from ptxtrain.moe.router import Router
from ptxtrain.nn.fp8_linear import Fp8LinearConfig, resolve_config, shared_input_quantization
from ptxtrain.nn.functional import swiglu

__all__ = ["MLP", "MoE"]


def _permute_kernels(triton: bool) -> tuple:
    """(permute, unpermute): the fused kernels, or the references; the unpermutation trusts
    the slots of the permutation before it (no range check: a host read)."""
    if triton:
        return permute_fused, functools.partial(unpermute_fused, check_slots=False)
    return permute_ref, functools.partial(unpermute_ref, check_slots=False)


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """Whether two process-group arguments name the same group (``None`` = the default group,
    so ``None`` and ``torch.distributed.group.WORLD`` are the same)."""
    world = dist.group.WORLD if dist.is_available() else None
    return (world if a is None else a) is (world if b is None else b)


class MLP(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) ⊙ w3 x)``: a dense FFN, one routed expert, or the shared experts.

    ``w1`` (gate) and ``w3`` (up) are ``[inter_dim, dim]``, ``w2`` (down) is ``[dim, inter_dim]``.
    ``kernels``: the gate's, as in :func:`ptxtrain._backend.use_triton_kernels` (a settable
    attribute, ``"auto"`` by default).
    """

    kernels = "auto"

    def __init__(self, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim] -> [..., dim]`` in ``x``'s dtype (the gate through
        :func:`ptxtrain.nn.functional.swiglu`)."""
        x_q = shared_input_quantization(x, self.w1, self.w3)  # one quantization of x (FP8)
        return self.w2(swiglu(self.w1(x, **x_q), self.w3(x, **x_q), kernels=self.kernels))


class MoE(nn.Module):
    """Shared + routed SwiGLU experts behind a :class:`~ptxtrain.moe.Router`.

    Args:
        dim: model width ``D``.
        moe_inter_dim: intermediate width of one expert.
        n_routed_experts / n_activated_experts: ``E`` and top-``k``.
        n_shared_experts: shared experts (0 = none).
        n_groups / n_limited_groups / route_scale / bias_update_speed / seq_aux_loss_alpha:
            passed to the :class:`Router`.
        kernels: ``"auto"`` (Triton kernels for CUDA inputs, references on the CPU), ``"ref"``
            or ``"triton"`` (see the module docstring); also a settable attribute.
        fp8_dispatch: with expert parallelism and FP8 experts, dispatch the tokens in FP8
            (default True; see the module docstring); also a settable attribute.

    Submodules: ``router`` (:class:`Router`), ``experts`` (:class:`Experts`, all ``E`` or, with
    expert parallelism, this rank's share), ``shared_experts`` (:class:`MLP` or None).

    Raises:
        ValueError: ``kernels`` is not one of ``"auto"``, ``"ref"``, ``"triton"``.
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
        kernels: str = "auto",
        fp8_dispatch: bool = True,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.fp8_dispatch = bool(fp8_dispatch)
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
        self.experts = Experts(n_routed_experts, dim, moe_inter_dim)
        self.shared_experts = (
            MLP(dim, n_shared_experts * moe_inter_dim) if n_shared_experts > 0 else None
        )
        self.ep_buffer: Buffer | None = None  # set by enable_expert_parallel

    @property
    def kernels(self) -> str:
        """``"auto"``, ``"ref"`` or ``"triton"``: where routing and (un)permutation run."""
        return self._kernels

    @kernels.setter
    def kernels(self, value: str) -> None:
        if value not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {value!r}")
        self._kernels = value

    def forward(self, x: torch.Tensor, *, return_aux_loss: bool = False):
        """Apply the layer to ``x [B, T, D]`` (or ``[N, D]``, treated as one sequence).

        Returns:
            ``y`` (same shape and dtype as ``x``), or ``(y, aux_loss)`` when ``return_aux_loss``
            (``aux_loss``: the router's sequence-wise balance loss, fp32 scalar or ``None``).

        Raises:
            TypeError / ValueError: ``x`` is not a float tensor of rank 2 or 3 with last dim ``D``;
                ``kernels="triton"`` with a float64 ``x``, or (interpreter off) a CPU ``x``.
        """
        check_tensor("x", x, ndim=(2, 3))
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dim {self.dim}, got shape {tuple(x.shape)}")
        seq_len = x.shape[1] if x.dim() == 3 else x.shape[0]
        flat = x.reshape(-1, self.dim)  # [N, D]
        triton = use_triton_kernels(self.kernels, flat)
        if triton:
            topk_idx, topk_weights, aux_loss = route_fused(self.router, flat, seq_len=seq_len)
        else:
            topk_idx, topk_weights, aux_loss = self.router(
                flat, seq_len=seq_len, return_aux_loss=True
            )  # [N, k], [N, k], scalar | None
        y = self._routed(flat, topk_idx, topk_weights, triton)  # [N, D]
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        y = y.view_as(x)
        return (y, aux_loss) if return_aux_loss else y

    # ------------------------------------------------------------------ expert parallelism
    def enable_expert_parallel(
        self, group: dist.ProcessGroup | None = None, buffer: Buffer | None = None
    ) -> None:
        """Keep only this rank's experts and route tokens through a :class:`~ptxtrain.ep.Buffer`.

        Rank ``r`` of the ``R`` ranks of ``group`` keeps experts ``[r·E/R, (r+1)·E/R)`` (copies of
        the slices of the full stacks, so build every rank's layer identically first, then call
        this; build the optimizer afterwards). Call it once.

        Args:
            group: the expert-parallel process group; ``None`` = the default group.
            buffer: an existing :class:`~ptxtrain.ep.Buffer` over ``group`` to use, typically one
                shared by every MoE layer of a model (an ``"nvlink"`` buffer holds ``num_nvl_bytes``
                of symmetric memory, 1 GiB by default: one per layer does not fit). Sharing is
                safe as long as the layers' dispatch / combine (and their backward passes) run one
                at a time on one CUDA stream, as with any collective (every rank in the same
                order): all per-call state lives in the :class:`~ptxtrain.ep.DispatchHandle`.
                ``None`` (default): a new ``Buffer(group)`` (``"all_to_all"``) for this layer.

        Raises:
            TypeError: ``buffer`` is not a :class:`~ptxtrain.ep.Buffer`.
            ValueError: no initialized process group, ``E`` not a multiple of ``R``, expert
                parallelism already on, or ``buffer.group`` is not ``group`` (``None`` and the
                default group count as the same).
        """
        if self.ep_buffer is not None:
            raise ValueError("expert parallelism is already enabled on this MoE layer")
        if buffer is None:
            buffer = Buffer(group)  # raises without an initialized process group
        elif not isinstance(buffer, Buffer):
            raise TypeError(
                f"buffer must be a ptxtrain.ep.Buffer or None, got {type(buffer).__name__}"
            )
        elif not _same_group(buffer.group, group):
            raise ValueError(
                f"buffer.group must be the expert-parallel group given (group={group!r}), got "
                f"buffer.group={buffer.group!r}"
            )
        n_ranks = buffer.num_ranks
        if self.n_routed_experts % n_ranks != 0:
            raise ValueError(
                f"n_routed_experts={self.n_routed_experts} must be divisible by the "
                f"expert-parallel group size {n_ranks}"
            )
        per_rank = self.n_routed_experts // n_ranks
        self.experts.keep_experts_(buffer.rank * per_rank, per_rank)
        self.ep_buffer = buffer

    @property
    def ep_size(self) -> int:
        """Ranks the experts are split over (1 without expert parallelism)."""
        return 1 if self.ep_buffer is None else self.ep_buffer.num_ranks

    def fp8_grouped_linears(self, tokens: int) -> list[tuple[torch.Tensor, int, Fp8LinearConfig]]:
        """The FP8 grouped linears a training step on ``tokens`` tokens runs in this layer,
        for :func:`ptxtrain.nn.prewarm.fp8_kernels` (which compiles their GEMMs ahead).

        ``tokens``: the rows this rank's forward gives the layer (one micro-batch). With expert
        parallelism every rank of the group sends as many, so the local experts receive
        ``ep_size x tokens x top-k / E`` rows each on average.

        Returns:
            ``[(weight, rows, config), ...]`` of :meth:`ptxtrain.moe.Experts.fp8_grouped_gemms`
            (``[E_local, N_out, K]`` weights: the stacked gate/up one, w1 and w3 for their
            Wgrads, w2): ``rows`` is the expected padded row count, each local expert's share
            of ``ep_size x tokens x top-k`` rounded up to 128 (the routing moves it; a miss
            compiles on demand), ``config`` the experts' resolved
            :class:`~ptxtrain.nn.Fp8LinearConfig` (with the GEMMs a weight does not run turned
            off). Empty when the experts run in high precision (``experts.fp8`` False).
        """
        ex = self.experts
        if not ex.fp8:
            return []
        cfg = resolve_config(ex.fp8_config)
        routed = tokens * self.ep_size * self.router.top_k  # rows dispatched to all E experts
        share = max(ceil_div(routed, max(self.n_routed_experts, 1)), 1)
        rows = ex.num_local_experts * ceil_div(share, M_GROUPED_ALIGNMENT) * M_GROUPED_ALIGNMENT
        return ex.fp8_grouped_gemms(rows, cfg)

    @torch.no_grad()
    def sync_expert_counts(self) -> None:
        """All-reduce (sum) ``router.expert_counts`` over the expert-parallel group, so that
        ``router.update_bias()`` sees the global load on every rank (a no-op without expert
        parallelism; a collective with it)."""
        if self.ep_buffer is not None:
            dist.all_reduce(self.router.expert_counts, group=self.ep_buffer.group)

    # ------------------------------------------------------------------ routed experts
    def _routed(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        triton: bool = False,
    ) -> torch.Tensor:
        """Routed experts: permute, :class:`Experts`, weighted un-permute (dispatch/combine
        around them with expert parallelism); ``triton``: the kernels of
        :mod:`ptxtrain.moe.fused`."""
        if self.ep_buffer is not None:
            return self._routed_ep(x, topk_idx, topk_weights, triton)
        # The FP8 grouped GEMMs need each expert's rows padded to 128; the BF16 grouped GEMM
        # takes any offsets. Sized on the host from N·k: no host sync (grouped_layout's note).
        align = M_GROUPED_ALIGNMENT if self.experts.fp8 else 1
        layout = build_grouped_layout(topk_idx, self.n_routed_experts, align)
        x_pad = scatter_to_layout(x, layout, triton=triton)  # [R, D]
        y_pad = self.experts.forward_layout(x_pad, layout)  # [R, D]
        return combine_from_layout(y_pad, topk_weights, layout, triton=triton)  # [N, D]

    def _routed_ep(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        triton: bool = False,
    ) -> torch.Tensor:
        """Dispatch (FP8 with FP8 experts, see the module docstring), local experts on the
        received rows, combine."""
        buffer = self.ep_buffer
        n_local = self.experts.num_local_experts
        permute, unpermute = _permute_kernels(triton)
        fp8 = self.fp8_dispatch and self.experts.fp8 and x.dtype != torch.float64
        if fp8:
            dispatched = dispatch_fp8(buffer, x, topk_idx, topk_weights, self.n_routed_experts)
        else:
            dispatched = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=self.n_routed_experts
            )
        recv_x, recv_idx, recv_w, recv_counts, handle, _ = dispatched
        # recv_x [M, D] in x's dtype, recv_idx [M, k] local ids or -1, recv_w [M, k] (0 where -1)
        # Slots of other ranks' experts go to a spill expert n_local, sorted last: only the
        # rows before them are copied, and in the combine those slots add nothing. The rows
        # per local expert are the dispatch's host counts (read with its split sizes, the one
        # host sync of the layer), so the permutation's device counts stay unread.
        spill_idx = torch.where(recv_idx >= 0, recv_idx, n_local)  # [M, k]
        n_valid = sum(recv_counts)
        x_valid, sorted_slots, _ = permute(
            recv_x, spill_idx, n_local + 1, check_ids=False, num_valid=n_valid
        )  # [n_valid, D]
        y_valid = self.experts(x_valid, recv_counts)  # [n_valid, D]
        y_recv = unpermute(y_valid, sorted_slots, recv_w, num_valid=n_valid)  # [M, D]
        return buffer.combine(y_recv, handle)[0]  # [N, D]
