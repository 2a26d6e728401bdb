"""DeepSeek-V3 model configuration: one frozen dataclass, validated on construction, plus presets.

Field names follow DeepSeek's reference inference code (``dim``, ``q_lora_rank``,
``n_activated_experts``...) so that numbers can be copied from the DeepSeek-V3 report
(arXiv 2412.19437, §2.1 MLA + DeepSeekMoE, §2.2 MTP, §4.2 hyper-parameters) by eye.

Presets (``get_preset``):

- ``tiny``     byte vocabulary, 2.4 M parameters (1.2 M activated per token): trains on a 2-core
  CPU in minutes (tests, CI).
- ``small``    94 M parameters (52 M activated per token; MTP included) for one GPU.
- ``medium``   DeepSeek-V2-Lite's widths at 8 layers: 4.19 G parameters, 0.68 G activated per
  token in the main model (the report's convention; with the MTP block 4.78 G / 0.77 G), for one
  H200 (BF16 weights, FP32 gradients and the 8-byte optimizer state: ~67 GB before activations).
  Never build it on a CPU: inspect it on ``torch.device("meta")``.
- ``v3-layer`` one MoE decoder layer at the real DeepSeek-V3 dimensions, for benchmarks only
  (11.5 G parameters, 0.59 G activated: never build it on a CPU; inspect it on
  ``torch.device("meta")``).

The defaults of the dataclass are the ``tiny`` preset.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PRESETS", "DeepSeekV3Config", "get_preset"]


@dataclass(frozen=True)
class DeepSeekV3Config:
    """Hyper-parameters of a DeepSeek-V3-style model (MLA + DeepSeekMoE + optional MTP).

    Raises:
        TypeError: a field has the wrong type (bools are not ints).
        ValueError: a field is out of range or inconsistent with another; the message names it.
    """

    # --- vocabulary and trunk ---
    vocab_size: int = 256  # tokens in the vocabulary (256 = raw bytes)
    dim: int = 128  # hidden size of the residual stream
    n_layers: int = 4  # decoder layers of the main model (the MTP block is extra)
    n_dense_layers: int = 1  # the first k layers use a dense SwiGLU MLP instead of MoE
    dense_inter_dim: int = 384  # intermediate size of those dense MLPs
    # --- multi-head latent attention (report §2.1.1) ---
    n_heads: int = 4  # attention heads
    q_lora_rank: int = 96  # query compression rank d_c'; 0 = plain query projection `wq`
    kv_lora_rank: int = 64  # key/value compression rank d_c
    qk_nope_head_dim: int = 32  # per-head query/key dims without rotary embedding
    qk_rope_head_dim: int = 16  # per-head decoupled rotary dims d_h^R (even; key shared by heads)
    v_head_dim: int = 32  # per-head value dims
    # --- DeepSeekMoE (report §2.1.2) ---
    moe_inter_dim: int = 128  # intermediate size of one routed (and one shared) expert
    n_routed_experts: int = 8  # routed experts per MoE layer N_r
    n_shared_experts: int = 1  # shared experts N_s (fused into one MLP of n_shared x moe_inter_dim)
    n_activated_experts: int = 2  # routed experts per token K_r (top-k)
    n_expert_groups: int = 4  # expert groups for group-limited routing (1 = off)
    n_limited_groups: int = 2  # each token picks experts from at most this many groups (M)
    route_scale: float = 1.0  # routed scaling factor applied to the normalized gate weights
    bias_update_speed: float = 1e-2  # γ of auxiliary-loss-free balancing (per bias update)
    seq_aux_loss_alpha: float = 1e-4  # α of the sequence-wise balance loss (0 disables it)
    # --- multi-token prediction (report §2.2) ---
    mtp_depth: int = 1  # MTP modules: 0 (off) or 1 (predict the token after next)
    mtp_loss_weight: float = 0.3  # λ, weight of the MTP loss in the total loss
    # --- positions, numerics, initialization ---
    max_seq_len: int = 256  # longest sequence the model accepts (tokens)
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of every weight matrix and the embedding
    tie_embeddings: bool = False  # share the embedding matrix with the output head

    def __post_init__(self) -> None:
        ints = {f.name for f in dataclasses.fields(self) if f.type in ("int", int)}
        floats = {f.name for f in dataclasses.fields(self) if f.type in ("float", float)}
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DeepSeekV3Config.{name} must be an int, got {value!r}")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"DeepSeekV3Config.{name} must be a float, got {value!r}")
            object.__setattr__(self, name, float(value))  # JSON may give 1 for 1.0
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"DeepSeekV3Config.{name} must be finite, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(
                f"DeepSeekV3Config.tie_embeddings must be a bool, got {self.tie_embeddings!r}"
            )

        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(
                    f"DeepSeekV3Config.{name} {what}, got {name}={getattr(self, name)!r}"
                )

        for name in (
            "vocab_size", "dim", "n_layers", "dense_inter_dim", "n_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_inter_dim",
            "n_routed_experts", "n_activated_experts", "n_expert_groups", "n_limited_groups",
            "max_seq_len",
        ):  # fmt: skip
            need(getattr(self, name) > 0, name, "must be > 0")
        for name in ("q_lora_rank", "n_shared_experts"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("route_scale", "rope_theta", "norm_eps", "init_std"):
            need(getattr(self, name) > 0, name, "must be > 0")
        for name in ("bias_update_speed", "seq_aux_loss_alpha", "mtp_loss_weight"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(
            0 <= self.n_dense_layers <= self.n_layers,
            "n_dense_layers",
            f"must be in [0, n_layers={self.n_layers}]",
        )
        need(
            self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (RoPE rotates pairs)"
        )
        need(
            self.n_activated_experts <= self.n_routed_experts,
            "n_activated_experts",
            f"(top-k) must be <= n_routed_experts={self.n_routed_experts}",
        )
        need(
            self.n_routed_experts % self.n_expert_groups == 0,
            "n_expert_groups",
            f"must divide n_routed_experts={self.n_routed_experts}",
        )
        need(
            self.n_limited_groups <= self.n_expert_groups,
            "n_limited_groups",
            f"must be <= n_expert_groups={self.n_expert_groups}",
        )
        per_group = self.n_routed_experts // self.n_expert_groups
        need(
            self.n_activated_experts <= self.n_limited_groups * per_group,
            "n_activated_experts",
            f"(top-k) must be <= n_limited_groups x experts per group = "
            f"{self.n_limited_groups} x {per_group} (the experts a token may reach)",
        )
        need(self.mtp_depth in (0, 1), "mtp_depth", "must be 0 or 1")

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        """MoE layers of the main model (the MTP block adds one more when it is an MoE block)."""
        return self.n_layers - self.n_dense_layers

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-able dict (ints, floats, bools)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepSeekV3Config:
        """Inverse of :meth:`to_dict`. Missing keys take the defaults (the ``tiny`` preset).

        Raises:
            TypeError: ``d`` is not a dict, or a value has the wrong type.
            ValueError: ``d`` holds a key that is not a field (listed with the valid ones), or
                a value is out of range.
        """
        if not isinstance(d, dict):
            raise TypeError(f"DeepSeekV3Config.from_dict needs a dict, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(
                f"DeepSeekV3Config.from_dict got unknown keys {unknown}; valid keys: {names}"
            )
        return cls(**d)


# DeepSeek-V2-Lite's widths (arXiv 2405.04434 appendix B and its published config: dim 2048,
# 16 heads, KV rank 512, 2 shared + 64 routed experts of 1408, top-6, a dense first layer of
# 10944) at 8 layers, with DeepSeek-V3's query compression (V2-Lite does not compress
# queries) and group-limited routing (8 groups, 4 per token). init_std 0.006 is the std
# DeepSeek-V2 and -V3 initialize with (V3 report §4.2), since this preset stands in for them
# in measurements; small's 0.02 (GPT-2's) would start every weight 3.3x larger at 2.7x small's
# width, where each matmul output already grows with sqrt(dim).
_MEDIUM = DeepSeekV3Config(
    vocab_size=256, dim=2048, n_layers=8, n_dense_layers=1, dense_inter_dim=10944, n_heads=16,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, moe_inter_dim=1408, n_routed_experts=64, n_shared_experts=2,
    n_activated_experts=6, n_expert_groups=8, n_limited_groups=4, route_scale=1.0,
    bias_update_speed=1e-3, seq_aux_loss_alpha=1e-4, mtp_depth=1, mtp_loss_weight=0.3,
    max_seq_len=2048, init_std=0.006,
)  # fmt: skip

_PRESETS: dict[str, DeepSeekV3Config] = {
    # The dataclass defaults: 4 layers (1 dense), dim 128, 8 routed experts top-2 in 4 groups.
    "tiny": DeepSeekV3Config(),
    # ~100 M total parameters for one GPU; MLA and MoE proportions after DeepSeek-V3, scaled down.
    "small": DeepSeekV3Config(
        vocab_size=256,
        dim=768,
        n_layers=12,
        n_dense_layers=1,
        dense_inter_dim=1536,
        n_heads=12,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        moe_inter_dim=128,
        n_routed_experts=16,
        n_shared_experts=2,
        n_activated_experts=4,
        n_expert_groups=4,
        n_limited_groups=2,
        route_scale=1.0,
        bias_update_speed=1e-3,
        seq_aux_loss_alpha=1e-4,
        mtp_depth=1,
        mtp_loss_weight=0.3,
        max_seq_len=1024,
        init_std=0.02,
    ),
    "medium": _MEDIUM,
    # One MoE layer at DeepSeek-V3's real sizes (report §4.2); benchmarks only.
    "v3-layer": DeepSeekV3Config(
        vocab_size=256,
        dim=7168,
        n_layers=1,
        n_dense_layers=0,
        dense_inter_dim=18432,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe_inter_dim=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=8,
        n_expert_groups=8,
        n_limited_groups=4,
        route_scale=2.5,
        bias_update_speed=1e-3,
        seq_aux_loss_alpha=1e-4,
        mtp_depth=0,
        mtp_loss_weight=0.3,
        max_seq_len=4096,
        init_std=0.006,
    ),
}

PRESETS: tuple[str, ...] = tuple(_PRESETS)


def get_preset(name: str) -> DeepSeekV3Config:
    """The named preset config (see the module docstring); configs are frozen, so it is shared.

    Raises:
        ValueError: ``name`` is not one of :data:`PRESETS` (the message lists them).
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {list(PRESETS)}")
    return _PRESETS[name]
