"""A DeepSeek-V3-style decoder: MLA attention, DeepSeekMoE, and depth-1 multi-token prediction.

Structure (DeepSeek-V3 report, arXiv 2412.19437, §2.1-2.2):

    embed -> [Block: h += MLA(RMSNorm(h)); h += FFN(RMSNorm(h))] x n_layers -> RMSNorm -> head
    FFN = dense SwiGLU MLP for the first ``n_dense_layers`` blocks, DeepSeekMoE after.
    MTP (depth 1): h'_i = proj([RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]) -> Block -> RMSNorm -> head
                   (shared embedding and head) predicts t_{i+2}.

Precision (docs/design.md §1): every projection and dense-MLP weight is a plain
``nn.Linear(bias=False)``, the candidates of the FP8 swap (:func:`fp8_module_filter` picks them);
the routed experts are stacked weights in an :class:`~ptxtrain.moe.experts.Experts` module whose
``fp8`` switch sends them through FP8 grouped GEMMs (:func:`convert_model_to_fp8_training` does
both). Never FP8 (they stay in the activation dtype or higher): the embedding, the output ``head``,
the router (an ``nn.Parameter``; gate GEMM in fp32), RMSNorm (computed in fp32), RoPE (computed in
complex64) and the attention core (``scaled_dot_product_attention`` in the activation dtype).
Cross-entropy runs in fp32. The router's selection bias stays fp32 through any module cast (see
``ptxtrain.moe.router``).

MLA follows the report's eqs. 1-11 without the inference-time weight absorption: keys and
values are decompressed with ``wkv_b`` and the decoupled RoPE key (one per token, shared by all
heads) is concatenated to every head's key; softmax scale ``1/sqrt(nope + rope)`` (no YaRN).
RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` as DeepSeek's reference code does.

Expert parallelism: :meth:`DeepSeekV3.enable_expert_parallel` splits every MoE layer's routed
experts over a process group (see :mod:`ptxtrain.moe.layer`); everything else stays replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ptxtrain._checks import check_positive_int, check_tensor
from ptxtrain.ep.buffer import BACKENDS as EP_BACKENDS
from ptxtrain.ep.buffer import DEFAULT_NVL_BYTES, Buffer
from ptxtrain.model.config import DeepSeekV3Config
from ptxtrain.moe.experts import Experts
from ptxtrain.moe.layer import MLP, MoE
from ptxtrain.moe.router import Router, load_stats
from ptxtrain.nn.fp8_linear import shared_input_quantization
from ptxtrain.nn.functional import mla_qk, rms_norm
from ptxtrain.nn.recompute import check_recompute, recompute

__all__ = [
    "MLA",
    "MTP",
    "Block",
    "DeepSeekV3",
    "ModelOutput",
    "RMSNorm",
    "build_model",
    "convert_model_to_fp8_training",
    "ep_nvl_bytes",
    "fp8_module_filter",
    "generate",
    "param_counts",
]

IGNORE_INDEX = -100  # label value that cross-entropy skips (padding)


# ---------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight``, computed in fp32 (fp64 for fp64 input), output in
    ``x``'s dtype: :func:`ptxtrain.nn.functional.rms_norm` (one Triton kernel each way on CUDA).

    ``kernels``: ``"auto"`` (default), ``"ref"`` or ``"triton"``, as in
    :func:`~ptxtrain._backend.use_triton_kernels`; a settable attribute.
    """

    kernels = "auto"

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, kernels=self.kernels)


def rope_freqs(seq_len: int, rope_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """``e^{i·t·θ_j}`` as complex64 ``[T, rope_dim/2]`` for positions ``0..T-1``, ``θ_j =
    theta^(-2j/rope_dim)`` (recomputed per forward: tiny, and immune to module dtype casts)."""
    inv_freq = theta ** (
        -torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


class MLA(nn.Module):
    """Multi-head latent attention (report §2.1.1), causal, no KV cache.

    ``recompute`` (set by :meth:`DeepSeekV3.set_recompute`): ``"selective"`` recomputes the
    up-projections and their norms in backward (:mod:`ptxtrain.nn.recompute`).

    Weights: ``wq_a [q_lora, D]``, ``q_norm``, ``wq_b [H·(nope+rope), q_lora]`` (or
    ``wq [H·(nope+rope), D]`` when ``q_lora_rank == 0``); ``wkv_a [kv_lora + rope, D]``,
    ``kv_norm``, ``wkv_b [H·(nope+v), kv_lora]``; ``wo [D, H·v]``.
    """

    recompute = "none"  # see the class docstring
    kernels = "auto"  # mla_qk's kernels (ptxtrain._backend.use_triton_kernels)

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        qk_dim = cfg.qk_head_dim
        if cfg.q_lora_rank == 0:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(
            cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)
        self.softmax_scale = qk_dim**-0.5

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]``, ``freqs [T, rope/2]`` complex64 -> ``[B, T, D]`` in ``x``'s dtype."""
        b, t, _ = x.shape
        h = self.n_heads
        selective = self.recompute == "selective"
        # The two down-projections of x quantize it once between them (FP8; else {}).
        down = self.wq if self.q_lora_rank == 0 else self.wq_a
        x_q = shared_input_quantization(x, down, self.wkv_a)
        if self.q_lora_rank == 0:
            q = self.wq(x, **x_q)
        else:  # the up-projection and its norm: recomputed in backward under "selective"
            q = recompute(self._q_up, self.wq_a(x, **x_q), enabled=selective)
        q = q.view(b, t, h, self.nope_dim + self.rope_dim)  # [B, T, H, nope|rope]

        kv = self.wkv_a(x, **x_q)  # [B, T, kv_lora + rope]
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # k_pe: one per token
        kv = recompute(self._kv_up, kv_c, enabled=selective)
        kv = kv.view(b, t, h, self.nope_dim + self.v_dim)  # [B, T, H, nope|v]
        # q with its rope part rotated, k = [k_nope | rotated k_pe on every head] ([B, T, H, qk]),
        # v = kv[..., nope:] (a view)
        q, k, v = mla_qk(q, kv, k_pe, freqs, kernels=self.kernels)

        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.softmax_scale,
        )  # [B, H, T, v]
        return self.wo(o.transpose(1, 2).reshape(b, t, h * self.v_dim))

    def _q_up(self, q_a: torch.Tensor) -> torch.Tensor:
        return self.wq_b(self.q_norm(q_a))

    def _kv_up(self, kv_c: torch.Tensor) -> torch.Tensor:
        return self.wkv_b(self.kv_norm(kv_c))


class Block(nn.Module):
    """Pre-norm decoder block: ``h += attn(attn_norm(h)); h += ffn(ffn_norm(h))``.

    ``ffn`` is an :class:`~ptxtrain.moe.layer.MLP` (``dense_inter_dim``) when ``moe`` is False,
    else a :class:`~ptxtrain.moe.MoE`.
    """

    recompute = "none"  # "selective": the RMSNorms; "full": the whole block (the caller)

    def __init__(self, cfg: DeepSeekV3Config, *, moe: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn: nn.Module
        if moe:
            self.ffn = MoE(
                cfg.dim,
                cfg.moe_inter_dim,
                cfg.n_routed_experts,
                cfg.n_activated_experts,
                n_shared_experts=cfg.n_shared_experts,
                n_groups=cfg.n_expert_groups,
                n_limited_groups=cfg.n_limited_groups,
                route_scale=cfg.route_scale,
                bias_update_speed=cfg.bias_update_speed,
                seq_aux_loss_alpha=cfg.seq_aux_loss_alpha,
            )
        else:
            self.ffn = MLP(cfg.dim, cfg.dense_inter_dim)

    def forward(
        self, x: torch.Tensor, freqs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, T, D]``, ``freqs [T, rope/2]`` complex64 -> (``[B, T, D]``, the MoE balance
        loss or ``None``)."""
        selective = self.recompute == "selective"  # RMSNorms recomputed in backward
        x = x + self.attn(recompute(self.attn_norm, x, enabled=selective), freqs)
        aux = None
        h = recompute(self.ffn_norm, x, enabled=selective)
        if isinstance(self.ffn, MoE):
            y, aux = self.ffn(h, return_aux_loss=True)
        else:
            y = self.ffn(h)
        return x + y, aux


class MTP(nn.Module):
    """Depth-1 multi-token prediction module (report §2.2, eq. 21-22) minus the shared parts.

    ``proj`` maps ``[hnorm(h_i); enorm(Emb(t_{i+1}))]`` (``2D``) to ``D``; then ``block`` and the
    final ``norm``; the caller applies the shared embedding and output head.
    """

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__()
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        # An MoE block like the main model's later layers (a dense one for an all-dense model).
        self.block = Block(cfg, moe=cfg.n_dense_layers < cfg.n_layers)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self, h: torch.Tensor, emb_next: torch.Tensor, freqs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``h [B, T', D]`` main-model hidden (before its final norm), ``emb_next [B, T', D]`` the
        embeddings of the next tokens -> (normalized hidden ``[B, T', D]``, balance loss | None)."""
        x = self.proj(torch.cat((self.hnorm(h), self.enorm(emb_next)), dim=-1))
        x, aux = recompute(self.block, x, freqs, enabled=self.block.recompute == "full")
        return self.norm(x), aux


@dataclass
class ModelOutput:
    """Result of :meth:`DeepSeekV3.forward`.

    Attributes:
        logits: ``[B, T, V]`` next-token logits in the activation dtype.
        loss: total fp32 scalar ``lm_loss + mtp_loss_weight · mtp_loss + aux_loss`` (terms that
            are ``None`` are left out); ``None`` without labels.
        lm_loss: fp32 cross-entropy of ``logits`` against ``labels``; ``None`` without labels.
        mtp_loss: fp32 cross-entropy of the MTP prediction of ``labels[:, t+1]`` at positions
            ``t < T-1``; ``None`` without labels, with ``mtp_depth == 0`` or ``T == 1``.
        aux_loss: fp32 sum of the sequence-wise balance losses of all MoE layers (the MTP
            block's included); ``None`` in eval mode or with ``seq_aux_loss_alpha == 0``.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def _check_ids(name: str, ids: object, vocab_size: int, *, allow_ignore: bool) -> torch.Tensor:
    """Validate ``[B, T]`` int64 token ids in ``[0, vocab_size)`` (or ``IGNORE_INDEX``).

    CPU ids: a ValueError naming the first bad id. CUDA ids: an asynchronous device-side assert
    (reading the check back would stall the host in every step, and keep the step out of a CUDA
    graph; an out-of-range id would fault in the embedding anyway), so validate ids on the host
    before moving them (``ptxtrain train``'s byte ids are in range by construction: it refuses a
    ``vocab_size`` below 256)."""
    ids = check_tensor(name, ids, dtypes=(torch.int64,), ndim=2)
    if ids.numel() == 0:
        return ids
    ok = (ids >= 0) & (ids < vocab_size)
    if allow_ignore:
        ok |= ids == IGNORE_INDEX
    if ids.is_cuda:
        torch._assert_async(ok.all(), f"{name} must hold token ids in [0, {vocab_size})")
        return ids
    if not bool(ok.all()):
        bad = ids[~ok][0].item()
        extra = f" or {IGNORE_INDEX} (ignored)" if allow_ignore else ""
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}){extra}, found {bad}")
    return ids


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy of ``logits [..., V]`` vs ``targets [...]``, skipping -100."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(acc),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


# ---------------------------------------------------------------------------- the model
class DeepSeekV3(nn.Module):
    """DeepSeek-V3-style causal language model (see the module docstring).

    Submodules: ``embed`` (``nn.Embedding``), ``layers`` (``ModuleList`` of :class:`Block`),
    ``norm``, ``head`` (``nn.Linear(dim, vocab)``; shares ``embed.weight`` when
    ``tie_embeddings``), ``mtp`` (:class:`MTP` or ``None``).

    The constructor leaves PyTorch's default initialization; :func:`build_model` is the way to
    get DeepSeek's ``normal(0, init_std)`` init, the dtype and the device.
    """

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        if not isinstance(config, DeepSeekV3Config):
            raise TypeError(f"config must be a DeepSeekV3Config, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            Block(config, moe=i >= config.n_dense_layers) for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = MTP(config) if config.mtp_depth == 1 else None
        self.recompute = "none"  # activation recomputation: set_recompute
        self.ep_group: dist.ProcessGroup | None = None  # set by enable_expert_parallel
        self.ep_size = 1
        self.ep_buffer: Buffer | None = None  # the MoE layers' shared Buffer (expert parallel)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """DeepSeek's init, in module order: every ``nn.Linear``, the embedding, the stacked
        routed-expert weights (``w1``, ``w3``, ``w2``) and the router weights
        ``~ normal(0, init_std)``; RMSNorm weights 1; router bias and counters 0.

        Deterministic given ``generator`` (or the current default RNG of the parameters'
        device when ``None``).
        """
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, Experts):
                for w in (module.w1, module.w3, module.w2):
                    w.normal_(0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, Router):
                module.weight.normal_(0.0, std, generator=generator)
                module.bias.zero_()
                module.expert_counts.zero_()

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        """Logits for every position, and the training losses when ``labels`` are given.

        Args:
            input_ids: ``[B, T]`` int64 token ids in ``[0, vocab_size)``, ``1 <= T <= max_seq_len``.
            labels: ``[B, T]`` int64, already shifted: ``labels[:, t]`` is the token after
                ``input_ids[:, t]``; ``-100`` marks positions to ignore. The MTP module predicts
                ``labels[:, t+1]`` from position ``t`` (it reads ``input_ids[:, t+1]``).

        Returns:
            :class:`ModelOutput` (logits in the activation dtype, losses fp32).

        Raises:
            TypeError: ids/labels are not int64 tensors.
            ValueError: wrong rank, ``T`` outside ``[1, max_seq_len]``, labels of another shape,
                ids outside the vocabulary.
        """
        cfg = self.config
        input_ids = _check_ids("input_ids", input_ids, cfg.vocab_size, allow_ignore=False)
        b, t = input_ids.shape
        if not 1 <= t <= cfg.max_seq_len:
            raise ValueError(
                f"input_ids must have 1 <= T <= max_seq_len={cfg.max_seq_len}, got shape {(b, t)}"
            )
        if labels is not None:
            labels = _check_ids("labels", labels, cfg.vocab_size, allow_ignore=True)
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels must have the shape of input_ids {(b, t)}, got {tuple(labels.shape)}"
                )

        freqs = rope_freqs(t, cfg.qk_rope_head_dim, cfg.rope_theta, input_ids.device)
        h = self.embed(input_ids)  # [B, T, D]
        aux_terms = []
        full = self.recompute == "full"  # each layer keeps its input only
        for layer in self.layers:
            h, aux = recompute(layer, h, freqs, enabled=full)
            if aux is not None:
                aux_terms.append(aux)
        logits = self.head(self.norm(h))  # [B, T, V]
        out = ModelOutput(logits=logits)
        if labels is None:
            return out

        out.lm_loss = lm_cross_entropy(logits, labels)
        if self.mtp is not None and t > 1:
            emb_next = self.embed(input_ids[:, 1:])  # [B, T-1, D] = Emb(t_{i+1})
            h_mtp, aux = self.mtp(h[:, :-1], emb_next, freqs[: t - 1])
            if aux is not None:
                aux_terms.append(aux)
            out.mtp_loss = lm_cross_entropy(self.head(h_mtp), labels[:, 1:])
        if aux_terms:
            out.aux_loss = torch.stack(aux_terms).sum()
        loss = out.lm_loss
        if out.mtp_loss is not None:
            loss = loss + cfg.mtp_loss_weight * out.mtp_loss
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        out.loss = loss
        return out

    def set_recompute(self, mode: str) -> None:
        """Which activations the backward recomputes instead of keeping (report §3.2.3;
        :mod:`ptxtrain.nn.recompute`): ``"none"``, ``"selective"`` (every RMSNorm and MLA's
        up-projections with their norms) or ``"full"`` (every decoder layer, the MTP block's
        included, keeps only its input). Values and gradients are unchanged (the recomputed
        forward is the same deterministic computation); the routers count their tokens once.

        Raises:
            ValueError: ``mode`` is not one of those.
        """
        mode = check_recompute(mode)
        self.recompute = mode
        for module in self.modules():
            if isinstance(module, (Block, MLA)):
                module.recompute = mode

    # ------------------------------------------------------------------ MoE balancing
    def routers(self) -> list[Router]:
        """Every MoE router in module order (main layers first, then the MTP block's)."""
        return [m for m in self.modules() if isinstance(m, Router)]

    def moe_load_stats(self) -> dict[str, float]:
        """Load statistics of the tokens counted since the last bias update, without updating.

        With expert parallelism the counts are summed over the group first (a collective; the
        routers' own counters are left as they are). See :meth:`update_router_biases` for the keys.
        """
        routers = self.routers()
        counts = self._global_expert_counts(routers)
        stats = [load_stats(c) for c in counts]
        return aggregate_router_stats(stats, _bias_abs_max(routers))

    @torch.no_grad()
    def _global_expert_counts(self, routers: list[Router]) -> list[torch.Tensor]:
        """Each router's ``expert_counts``, summed over the expert-parallel group (one
        all-reduce of the concatenation), as new tensors."""
        counts = [r.expert_counts.clone() for r in routers]
        if self.ep_group is None or not counts:
            return counts
        flat = torch.cat([c.reshape(-1) for c in counts])
        dist.all_reduce(flat, group=self.ep_group)
        return list(flat.split([c.numel() for c in counts]))

    def update_router_biases(self, *, stats: bool = True) -> dict[str, float] | None:
        """Apply one auxiliary-loss-free bias update to every router and reset their counters.

        Call once per optimizer step, after the backward passes of all micro-batches. With
        expert parallelism (:meth:`enable_expert_parallel`) the counts are first all-reduced
        over the group, so every rank applies the same update from the global expert load (a
        collective: every rank must call it); other data-parallel setups must all-reduce each
        router's ``expert_counts`` themselves first.

        Returns:
            ``n_moe_layers``; ``tokens`` (token-slots counted, summed over layers);
            ``max_load_ratio``: the **worst** (largest) max/mean tokens-per-expert over layers;
            ``min_load_ratio``: the worst (smallest) min/mean over layers;
            ``cv``: coefficient of variation (std/mean) **averaged** over layers; ``cv_max``: its
            worst layer; ``bias_abs_max``: the largest ``|b_i|`` after the update. Ratios are
            NaN when nothing was counted (eval-mode forwards do not count). With
            ``stats=False``: None, and nothing is read back to the host (the update is device
            work only, CUDA-graph safe); :meth:`last_router_stats` reads them later.
        """
        routers = self.routers()
        if self.ep_group is not None:
            for r, c in zip(routers, self._global_expert_counts(routers), strict=True):
                r.expert_counts.copy_(c)
        for r in routers:
            r.update_bias(stats=False)
        return self.last_router_stats() if stats else None

    def last_router_load(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What :meth:`last_router_stats` reads, as device tensors (no host sync): every
        router's counts of the last update stacked ``[L, E]`` int64, and the largest ``|b_i|``
        (0-d fp32); None without routers."""
        routers = self.routers()
        if not routers:
            return None
        counts = torch.stack([r.last_counts for r in routers])  # [L, E]
        return counts, torch.stack([r.bias.abs().max() for r in routers]).max()

    def last_router_stats(self) -> dict[str, float]:
        """The statistics :meth:`update_router_biases` returns, for its last call (one host
        read of every router's counts and bias)."""
        load = self.last_router_load()
        if load is None:
            return aggregate_router_stats([], 0.0)
        return router_stats_from(load[0].cpu(), float(load[1]))

    # ------------------------------------------------------------------ expert parallelism
    def enable_expert_parallel(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str = "all_to_all",
        max_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Split every MoE layer's routed experts over the ranks of ``group`` (in place).

        Rank ``r`` of ``R`` keeps experts ``[r·E/R, (r+1)·E/R)`` of every MoE layer (the MTP
        block's included): slices of the full model, so build the full model identically on
        every rank first (same seed), then call this, then build the optimizer. Each rank then
        runs the whole model on its own tokens; the MoE layers exchange tokens through ONE
        :class:`~ptxtrain.ep.Buffer` shared by every layer (``self.ep_buffer``; forward and
        backward are collectives over ``group``). Sharing is safe while the layers' calls run
        one at a time on one CUDA stream (see :mod:`ptxtrain.moe.layer`): not with the pipeline
        schedules' F&B overlap on two streams (``PTXTRAIN_PP_OVERLAP=1``) and ``"nvlink"``.

        Gradients after ``backward`` (each rank's loss over its own tokens): a replicated
        parameter holds this rank's gradient (average it over the ranks for data parallelism);
        an expert parameter holds the sum over **all** ranks' losses of the gradient with
        respect to its local expert (scale it by ``1/R`` to get the gradient of the mean loss).

        Args:
            group: the expert-parallel process group; ``None`` = the default group.
            backend: the Buffer's backend, ``"all_to_all"`` (default; any process group) or
                ``"nvlink"`` (an NCCL group of the GPUs of one node; :mod:`ptxtrain.ep.nvlink`).
            max_tokens: ``"nvlink"``: the most tokens one rank passes through the model in one
                forward (``B·T`` of its largest batch, sampling included), which sizes the buffer
                (:func:`ep_nvl_bytes`); ``None``: the Buffer's default (1 GiB). Ignored by
                ``"all_to_all"``.
            timeout_s: the Buffer's bound on every wait for a peer, seconds (its gloo
                exchanges, the nvlink kernels' flag waits); ``None``: the Buffer's default.

        Raises:
            ValueError: no initialized process group, ``n_routed_experts`` not divisible by the
                group size, expert parallelism already enabled, an unknown ``backend``, or
                ``"nvlink"`` on a group that is not NCCL or without CUDA (raised before any
                layer changes).
            TypeError / ValueError: ``max_tokens`` not a positive int, ``timeout_s`` not a
                positive number.
            RuntimeError: the ``"nvlink"`` transport could not be set up (symmetric memory,
                NVRTC). This can happen on one rank alone; the others then wait in the
                Buffer's collective setup until the process group's timeout.
        """
        if self.ep_group is not None:
            raise ValueError("expert parallelism is already enabled on this model")
        if backend not in EP_BACKENDS:
            raise ValueError(f"backend must be one of {EP_BACKENDS}, got {backend!r}")
        if max_tokens is not None:
            check_positive_int("max_tokens", max_tokens)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "enable_expert_parallel needs an initialized torch.distributed process group"
            )
        size = dist.get_world_size(group)
        if self.config.n_routed_experts % size != 0:
            raise ValueError(
                f"n_routed_experts={self.config.n_routed_experts} must be divisible by the "
                f"expert-parallel group size {size}"
            )
        kwargs = {}
        if backend == "nvlink":
            pg_backend = str(dist.get_backend(group))
            if "nccl" not in pg_backend:
                raise ValueError(
                    f"backend='nvlink' needs an NCCL process group of the CUDA GPUs of one node, "
                    f"got a {pg_backend!r} group; use backend='all_to_all'"
                )
            if max_tokens is not None:
                dtype = next(self.parameters()).dtype
                kwargs["num_nvl_bytes"] = ep_nvl_bytes(self.config, max_tokens, size, dtype)
        if timeout_s is not None:
            kwargs["timeout_s"] = timeout_s  # the Buffer checks it
        buffer = Buffer(group, backend=backend, **kwargs)  # "nvlink" without CUDA raises here
        for moe in self.moe_layers():
            moe.enable_expert_parallel(group, buffer=buffer)
        self.ep_buffer = buffer
        self.ep_group = group if group is not None else dist.group.WORLD
        self.ep_size = size

    def moe_layers(self) -> list[MoE]:
        """Every MoE layer in module order (main layers first, then the MTP block's)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' stacked weights (``w1``, ``w3``, ``w2`` of every MoE layer), the
        parameters that expert parallelism shards rather than replicates."""
        return [p for m in self.modules() if isinstance(m, Experts) for p in m.parameters()]

    # ------------------------------------------------------------------ sizes
    def num_params(self) -> dict[str, int]:
        """Parameter counts of the whole model (works on the meta device; with expert
        parallelism the experts held by other ranks are counted too).

        Returns:
            ``total``: every parameter (tied weights once, MTP included);
            ``activated``: parameters one token uses (the routed experts counted ``k`` of ``E``
            per MoE layer; embedding and MTP included);
            ``mtp_total`` / ``mtp_activated``: the MTP module's share (subtract for the report's
            main-model convention, e.g. 671 B total / 37 B activated for DeepSeek-V3);
            ``embedding``: the embedding matrix.
        """

        total, activated = param_counts(self)
        mtp_total, mtp_activated = param_counts(self.mtp) if self.mtp is not None else (0, 0)
        return {
            "total": total,
            "activated": activated,
            "mtp_total": mtp_total,
            "mtp_activated": mtp_activated,
            "embedding": self.embed.weight.numel(),
        }


def param_counts(module: nn.Module) -> tuple[int, int]:
    """``(total, activated)`` parameters of ``module`` (any part of a :class:`DeepSeekV3`).

    ``total`` counts every parameter once (tied weights once), the routed experts that other
    expert-parallel ranks hold included; ``activated`` counts the routed experts of every MoE
    layer ``n_activated_experts`` of ``n_routed_experts`` (the parameters one token uses).
    Works on the meta device.
    """
    total = sum(p.numel() for p in module.parameters())
    unused = 0
    for moe in (m for m in module.modules() if isinstance(m, MoE)):
        ex = moe.experts
        per_expert = sum(p[0].numel() for p in ex.parameters())
        total += (ex.num_experts - ex.num_local_experts) * per_expert  # other EP ranks'
        unused += (moe.n_routed_experts - moe.n_activated_experts) * per_expert
    return total, total - unused


def ep_nvl_bytes(
    config: DeepSeekV3Config,
    max_tokens: int,
    num_ranks: int,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """``num_nvl_bytes`` of the nvlink :class:`~ptxtrain.ep.Buffer` shared by a model's MoE
    layers: :meth:`~ptxtrain.ep.Buffer.nvl_bytes_hint` for the largest message, or the
    Buffer's default (1 GiB) when that already fits.

    Rows per rank pair: a token is sent once to every rank holding one of its experts (not once
    per expert), so one rank sends at most ``max_tokens`` rows to another, in any dispatch,
    combine or their backward passes (the combine's rows are the dispatch's, reversed). The
    largest row is the high-precision dispatch row, ``H`` values of ``dtype`` plus the gate
    weights (fp32, fp64 for fp64 tokens), ``topk_idx`` (int64) and the token index (int64):
    ``H·size(dtype) + 12·k + 8`` bytes (``16·k + 8`` for fp64); an FP8 dispatch row
    (``H + 4·⌈H/128⌉ + 12·k + 8``), a combine row (``H·size(dtype)``) and the dispatch's
    backward (gradients of the activations and weights) are smaller, so this covers them.

    Args:
        config: the model's config (``dim`` = ``H``, ``n_activated_experts`` = ``k``).
        max_tokens: the most tokens one rank passes through the model in one forward.
        num_ranks: the expert-parallel group size ``R``.
        dtype: the activation dtype (default bfloat16).

    Returns:
        bytes, ``max(1 GiB, max_tokens · row · R)`` with ``row`` padded to 16 bytes.

    Raises:
        TypeError / ValueError: ``max_tokens`` / ``num_ranks`` not positive ints, ``dtype`` not
            a floating torch dtype.
    """
    check_positive_int("max_tokens", max_tokens)
    check_positive_int("num_ranks", num_ranks)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    meta = 16 if dtype == torch.float64 else 12  # gate weight + topk_idx per slot
    row = config.dim * dtype.itemsize + meta * config.n_activated_experts + 8  # + token index
    return max(DEFAULT_NVL_BYTES, Buffer.nvl_bytes_hint(max_tokens, row, num_ranks))


def _bias_abs_max(routers: list[Router]) -> float:
    return max((float(r.bias.abs().max()) for r in routers), default=0.0)


def router_stats_from(counts: torch.Tensor, bias_abs_max: float) -> dict[str, float]:
    """:func:`aggregate_router_stats` of per-router counts ``[L, E]`` (host tensor)."""
    return aggregate_router_stats([load_stats(c) for c in counts], bias_abs_max)


def aggregate_router_stats(stats: list[dict[str, float]], bias_abs_max: float) -> dict[str, float]:
    """Model-level MoE load statistics from per-router ones (the keys of
    :meth:`DeepSeekV3.update_router_biases`); ``bias_abs_max`` is the largest |bias| of any router.
    Used by the model and by the pipeline runner, whose routers live on several ranks."""
    counted = [s for s in stats if s["tokens"] > 0]
    nan = math.nan
    return {
        "n_moe_layers": float(len(stats)),
        "tokens": float(sum(s["tokens"] for s in stats)),
        "max_load_ratio": max((s["max_load_ratio"] for s in counted), default=nan),
        "min_load_ratio": min((s["min_load_ratio"] for s in counted), default=nan),
        "cv": sum(s["cv"] for s in counted) / len(counted) if counted else nan,
        "cv_max": max((s["cv"] for s in counted), default=nan),
        "bias_abs_max": bias_abs_max,
    }


# ---------------------------------------------------------------------------- public helpers
def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``convert_to_fp8_training``: True exactly for the modules that
    run in FP8.

    FP8: every ``nn.Linear`` of MLA (``wq``/``wq_a``/``wq_b``/``wkv_a``/``wkv_b``/``wo``), the dense
    MLPs, the shared experts (``w1``/``w2``/``w3``) and the MTP projection ``mtp.proj`` (the
    report keeps only the embedding, head, gating, norms and attention core in high precision,
    and ``proj`` is an ordinary GEMM on normalized inputs), and the routed experts
    (:class:`~ptxtrain.moe.experts.Experts`, stacked weights switched through their
    ``enable_fp8`` hook).
    Not FP8: the output ``head`` (also the embedding when tied), anything inside a router, and
    every other module.
    """
    if not isinstance(module, nn.Linear | Experts):
        return False
    parts = fqn.split(".")
    return parts[-1] != "head" and "router" not in parts


def convert_model_to_fp8_training(model: nn.Module, config=None) -> nn.Module:
    """Switch a model to FP8 training in place (DeepSeek-V3 report §3.3; docs/design.md §1):
    :func:`ptxtrain.nn.convert_to_fp8_training` with :func:`fp8_module_filter`.

    Swaps the Linears the filter selects for ``Fp8Linear`` and switches every
    :class:`~ptxtrain.moe.experts.Experts` module to FP8 (``fp8 = True``: its projections run
    through ``ptxtrain.nn.fp8_grouped.fp8_grouped_linear``, the same 1x128 / 128x128 recipe).
    Parameters are shared, not copied: an existing optimizer is unaffected.

    Args:
        model: a :class:`DeepSeekV3` (or any module holding such parts).
        config: an ``Fp8LinearConfig``, a recipe name, or None for ``"deepseek"``. A config that
            runs no GEMM in FP8 (the ``"bf16"`` recipe) changes nothing.

    Returns:
        ``model``.

    Raises:
        TypeError / ValueError: as :func:`ptxtrain.nn.convert_to_fp8_training` (a bad
            ``model`` or ``config``, an unknown recipe name).
    """
    from ptxtrain.nn import Fp8LinearConfig, convert_to_fp8_training

    if config is None or isinstance(config, str):
        config = Fp8LinearConfig.from_recipe_name(config or "deepseek")
    return convert_to_fp8_training(model, config, module_filter_fn=fp8_module_filter)


@torch.no_grad()
def build_model(
    config: DeepSeekV3Config,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> DeepSeekV3:
    """Build, initialize and place a :class:`DeepSeekV3`.

    The module is constructed on the meta device, cast to ``dtype``, materialized on ``device``
    (default CPU) and initialized in place (:meth:`DeepSeekV3.init_weights`), so the v3-layer
    preset never exists in fp32. Floating parameters are ``dtype``; the routers' selection bias
    stays fp32 (a γ = 1e-3 step is below bf16 resolution) and their counters int64.

    Args:
        config: the model config.
        dtype: floating dtype of the parameters (bf16 for training, fp32/fp64 for references).
        device: where to put the model.
        seed: seeds a private ``torch.Generator`` on ``device``; ``None`` draws from the current
            default RNG of ``device`` (deterministic under ``torch.manual_seed``).

    Raises:
        TypeError: ``config`` is not a config, ``dtype`` not a floating dtype, ``seed`` not an int.
        ValueError: ``seed`` outside ``[-2**63, 2**64)`` (what ``torch.Generator`` accepts).
    """
    if not isinstance(config, DeepSeekV3Config):
        raise TypeError(f"config must be a DeepSeekV3Config, got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if seed is not None and not -(2**63) <= seed < 2**64:  # torch.Generator's seed range
        raise ValueError(f"seed must lie in [-2**63, 2**64), got {seed}")
    device = torch.device("cpu" if device is None else device)
    with torch.device("meta"):
        model = DeepSeekV3(config)
    model.to(dtype=dtype)  # still on meta: free; the router bias stays fp32
    model.to_empty(device=device)
    if config.tie_embeddings:  # materializing off meta gives each module its own tensor
        model.head.weight = model.embed.weight
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    model.init_weights(generator)
    return model


@torch.no_grad()
def generate(
    model: DeepSeekV3,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample continuations by recomputing the whole (cropped) context for every new token.

    Each step runs the model on the last ``max_seq_len`` tokens, takes the final position's
    logits in fp32, divides by ``temperature`` (0 = greedy argmax), keeps the ``top_k`` largest
    (if given) and samples with ``torch.multinomial(generator=generator)``. The model runs in
    eval mode (no router counting) and gets its previous mode back.

    Args:
        model: a :class:`DeepSeekV3`.
        prompt_ids: ``[B, T0]`` int64 token ids, ``T0 >= 1`` (longer than ``max_seq_len`` is fine).
        max_new_tokens: tokens to append (``>= 0``).
        temperature: ``>= 0``.
        top_k: ``None`` or ``>= 1``.
        generator: RNG on the model's device for reproducible sampling.

    Returns:
        ``[B, T0 + max_new_tokens]`` int64: the prompt followed by the samples.

    Raises:
        TypeError / ValueError: bad argument types or ranges (message names the argument).
    """
    if not isinstance(model, DeepSeekV3):
        raise TypeError(f"model must be a DeepSeekV3, got {type(model).__name__}")
    cfg = model.config
    prompt_ids = _check_ids("prompt_ids", prompt_ids, cfg.vocab_size, allow_ignore=False)
    if prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must hold at least one token, got {tuple(prompt_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {temperature!r}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise TypeError(f"top_k must be an int or None, got {top_k!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")

    was_training = model.training
    model.eval()
    try:
        ids = prompt_ids
        for _ in range(max_new_tokens):
            logits = model(ids[:, -cfg.max_seq_len :]).logits[:, -1].float()  # [B, V]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = logits.softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
            ids = torch.cat((ids, nxt), dim=1)
    finally:
        model.train(was_training)
    return ids
