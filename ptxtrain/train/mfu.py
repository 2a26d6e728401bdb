"""Model FLOPs utilization (MFU): the model's training FLOPs per token and the device's peak.

MFU = ``model_flops_per_token(config, seq_len)`` x tokens/s / (devices x
``peak_bf16_flops(device)``). The FLOP count follows PaLM (arXiv 2204.02311, appendix B),
Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", §5.1) and torchtitan (``get_num_flop_per_token``): 6 FLOPs per matmul parameter and
token (2 forward, 4 backward) plus the attention score and value products, which have no
parameters. Unlike PaLM and torchtitan, which count the full ``T x T`` score matrix, the
attention term is halved for the causal mask (as FlashAttention's benchmarks count causal
attention): on ``medium`` at 2,048 tokens the attention term is ~6 % of the total, so this MFU
reads ~5 % lower than theirs would. It counts what the model needs, not what the implementation
runs: recomputation, the FP8 quantization and MoE dispatch work, and padding count nothing.
docs/performance.md ("How MFU is counted") states the convention for users.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..model.config import DeepSeekV3Config

__all__ = [
    "FlopsByPart",
    "achieved_flops",
    "flops_per_token_by_part",
    "model_flops_per_token",
    "peak_bf16_flops",
]

# Dense (no 2:4 sparsity) BF16 tensor-core peaks in FLOP/s, matched against
# torch.cuda.get_device_name() in order; the first match wins. Sources: NVIDIA's H100 and H200
# datasheets (their "BF16 Tensor Core" figures are with sparsity: 1,979 TFLOPS for SXM and 1,513
# for H100 PCIe, halved here); the H800 (SXM), the GPU of the DeepSeek-V3 report (§3.1), cuts
# the H100 SXM's interconnect, not its tensor-core peak. NVL and other variants are left out on
# purpose: a device that matches no row gets None (MFU "n/a") rather than a guess.
_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIE\b", 756e12),  # "NVIDIA H100 PCIe"
    (r"\bH(100|200|800)\b(?!.*\b(PCIE|NVL)\b)", 989e12),  # "NVIDIA H100 80GB HBM3", "NVIDIA H200"
)


def peak_bf16_flops(device: torch.device | str) -> float | None:
    """The dense BF16 tensor-core peak of ``device`` in FLOP/s, or None when it is not known.

    Args:
        device: a ``torch.device`` (a CUDA one is named by ``torch.cuda.get_device_name``; CPU
            and other types give None), or a device name string as that function returns it,
            e.g. ``"NVIDIA H100 80GB HBM3"`` (matched case-insensitively).

    Returns:
        989e12 for H100 SXM, H200 SXM and H800 (SXM); 756e12 for H100 PCIe; None for every
        other device (CPU, unknown GPUs, NVL variants).

    Raises:
        TypeError: ``device`` is neither a ``torch.device`` nor a string.
    """
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = torch.cuda.get_device_name(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a torch.device or a device name, got {device!r}")
    name = device.upper()
    for pattern, flops in _PEAK_BF16_FLOPS:
        if re.search(pattern, name):
            return flops
    return None


def _meta_model(config: DeepSeekV3Config):
    """A ``DeepSeekV3`` of ``config`` on the meta device (no memory), for counting."""
    from ..model import DeepSeekV3

    with torch.device("meta"):
        return DeepSeekV3(config)


def _check_args(config: object, seq_len: object) -> None:
    if not isinstance(config, DeepSeekV3Config):
        raise TypeError(f"config must be a DeepSeekV3Config, got {type(config).__name__}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {seq_len!r}")
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")


@dataclass(frozen=True)
class FlopsByPart:
    """Training FLOPs per token of each part of the model (:func:`flops_per_token_by_part`).

    ``embed``: the embedding (0: a table lookup, not a matmul); ``layers[i]``: decoder layer
    ``i``; ``head``: the final norm and the output head; ``mtp``: the MTP module with its pass
    through the shared head (0 without MTP). :attr:`total` is
    :func:`model_flops_per_token`.
    """

    embed: int
    layers: tuple[int, ...]
    head: int
    mtp: int

    @property
    def total(self) -> int:
        """FLOPs per token of the whole model."""
        return self.embed + sum(self.layers) + self.head + self.mtp


def flops_per_token_by_part(config: DeepSeekV3Config, seq_len: int) -> FlopsByPart:
    """:func:`model_flops_per_token` split over the parts of the model (same convention).

    A decoder layer counts ``6 x`` its activated parameters (``param_counts``: the routed
    experts ``n_activated_experts`` of ``n_routed_experts``, the shared experts, the router,
    MLA, the two RMSNorms) plus the causal attention term ``3 x seq_len x n_heads x
    (qk_head_dim + v_head_dim)``; the head part ``6 x`` (final norm + ``vocab_size x dim``),
    tied or not; the MTP part its activated parameters, one more pass through the head and one
    attention term. Args and errors as :func:`model_flops_per_token`.
    """
    from ..model.deepseek import param_counts

    _check_args(config, seq_len)
    model = _meta_model(config)
    # 6 x T x H x (qk + v) / 2 with the halving done first: qk + v may be odd, T even or not
    attention = 3 * seq_len * config.n_heads * (config.qk_head_dim + config.v_head_dim)
    head = config.vocab_size * config.dim
    layers = tuple(6 * param_counts(layer)[1] + attention for layer in model.layers)
    mtp = 0
    if model.mtp is not None:
        mtp = 6 * (param_counts(model.mtp)[1] + head) + attention
    return FlopsByPart(0, layers, 6 * (model.norm.weight.numel() + head), mtp)


def model_flops_per_token(config: DeepSeekV3Config, seq_len: int) -> int:
    """Training FLOPs (forward + backward) the model needs per token at ``seq_len``.

    ``6 x P + 6 x L x seq_len x n_heads x (qk_head_dim + v_head_dim) / 2`` where

    - ``P``, the matmul parameters one token uses: ``DeepSeekV3.num_params()["activated"]``
      (every dense parameter, the shared experts, ``n_activated_experts`` routed experts per MoE
      layer, the routers, the output head, the MTP module when ``mtp_depth = 1``), minus the
      embedding (a table lookup, not a matmul; with ``tie_embeddings`` the shared matrix stays,
      since the output head multiplies by it), plus the output head once more per MTP module
      (the MTP module reuses the main model's head on its own hidden states);
    - ``L``, the decoder layers the step runs: ``n_layers`` plus the MTP module's block;
    - the attention term: ``Q K^T`` (``qk_head_dim`` per head) and ``P V`` (``v_head_dim``), 2
      FLOPs per multiply-add forward and 4 backward, over the ``seq_len`` keys of a token,
      halved for the causal mask (a token attends to ``seq_len / 2`` keys on average).

    The MTP module runs on ``seq_len - 1`` positions; it is counted on all of them (1 /
    ``seq_len`` too much). RMSNorm weights (``~2 x dim`` per layer) are counted as parameters,
    which is the convention's simplification. Sources: PaLM appendix B, Megatron-LM §5.1,
    torchtitan (their attention term is this one without the causal halving); the MLA and MoE
    sizes after the DeepSeek-V3 report §2.1. Per part: :func:`flops_per_token_by_part`.

    Args:
        config: the model.
        seq_len: tokens per sequence (> 0).

    Returns:
        FLOPs per token as an int (e.g. 7,879,872 for the ``tiny`` preset at ``seq_len`` 128).

    Raises:
        TypeError: ``config`` is not a ``DeepSeekV3Config``; ``seq_len`` is not an int.
        ValueError: ``seq_len`` <= 0.
    """
    return flops_per_token_by_part(config, seq_len).total


def achieved_flops(
    flops_per_token: float,
    tokens_per_s: float | None,
    peak_flops: float | None,
    devices: int = 1,
) -> dict[str, Any]:
    """What a throughput means in model FLOPs: the ``model_tflops`` and ``mfu`` record fields.

    Args:
        flops_per_token: :func:`model_flops_per_token`.
        tokens_per_s: tokens/s of the whole run (all devices together); None = not measured.
        peak_flops: one device's peak in FLOP/s (:func:`peak_bf16_flops`), or None.
        devices: devices (ranks) that produced ``tokens_per_s``.

    Returns:
        ``{"model_tflops": model TFLOP/s per device, "mfu": their fraction of the peak (0-1)}``;
        ``model_tflops`` is None without ``tokens_per_s``, ``mfu`` also without ``peak_flops``.
    """
    if tokens_per_s is None:
        return {"model_tflops": None, "mfu": None}
    per_device = flops_per_token * tokens_per_s / devices  # FLOP/s
    return {
        "model_tflops": per_device / 1e12,
        "mfu": per_device / peak_flops if peak_flops else None,
    }
