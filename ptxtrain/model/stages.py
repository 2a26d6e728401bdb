"""Pipeline stages of a :class:`~ptxtrain.model.deepseek.DeepSeekV3` (DESIGN §5, report §3.2).

The decoder layers are cut into ``n_stages`` equal, consecutive slices; stage 0 also holds the
embedding, the last stage the final norm and the output head. A stage *shares* its submodules with
the model it was cut from (no copy), so a rank can build the whole model from the seed, exactly as
the single-process run does, and hand its stages to a pipeline schedule.

Stage interface (what the schedules in :mod:`ptxtrain.parallel` pass between ranks):

- stage 0 takes ``(input_ids [B, T] int64,)``; every other stage takes ``(h, aux)``;
- every stage but the last returns ``(h [B, T, D] activation dtype, aux)``, the last returns
  ``(logits [B, T, V], aux)``;
- ``aux`` is a 0-d fp32 tensor: the running sum of the MoE sequence-wise balance losses of the
  layers run so far (report §2.1.2, eq. 17-20), 0 when there is none.

:meth:`DeepSeekV3Stage.loss` turns the last stage's outputs into ``lm_loss + aux_loss``, the
model's total loss without MTP. Multi-token prediction and tied embeddings are not supported here
(the MTP module needs the first stage's embedding on the last stage): :func:`check_stageable`
says so.
"""

from __future__ import annotations

import torch
from torch import nn

from ptxtrain.model.deepseek import DeepSeekV3, _cross_entropy, _rope_freqs

__all__ = ["DeepSeekV3Stage", "check_stageable", "split_layers"]


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """The layer indices of each stage: ``n_stages`` consecutive ranges of equal length.

    Raises:
        ValueError: ``n_stages < 1`` or ``n_layers`` not divisible by ``n_stages`` (the message
            names both).
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be an int >= 1, got {n_stages!r}")
    if n_layers % n_stages:
        raise ValueError(
            f"n_layers={n_layers} cannot be split into {n_stages} pipeline stages of equal size "
            f"(n_layers must be a multiple of {n_stages})"
        )
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def check_stageable(model_config, n_stages: int) -> None:
    """Raise ``ValueError`` if a model of ``model_config`` cannot be cut into ``n_stages`` stages.

    Checks: no MTP module (``mtp_depth == 0``), untied embeddings, and ``n_layers`` divisible by
    ``n_stages``.
    """
    if n_stages > 1 and model_config.mtp_depth != 0:
        raise ValueError(
            "multi-token prediction (mtp_depth=1) is not supported with pipeline parallelism: "
            "the MTP module needs the first stage's embedding on the last stage; turn it off "
            "(ptxtrain train --no-mtp)"
        )
    if n_stages > 1 and model_config.tie_embeddings:
        raise ValueError("tie_embeddings=True is not supported with pipeline parallelism")
    split_layers(model_config.n_layers, n_stages)


class DeepSeekV3Stage(nn.Module):
    """Stage ``index`` of ``n_stages`` of ``model`` (shares its submodules; see the module doc).

    Args:
        model: the full model the stage is cut from.
        index: ``0 <= index < n_stages``.
        n_stages: number of stages; must divide ``model.config.n_layers``.

    Raises:
        TypeError: ``model`` is not a :class:`DeepSeekV3`.
        ValueError: ``index`` out of range, or the model cannot be cut (:func:`check_stageable`).
    """

    def __init__(self, model: DeepSeekV3, index: int, n_stages: int) -> None:
        super().__init__()
        if not isinstance(model, DeepSeekV3):
            raise TypeError(f"model must be a DeepSeekV3, got {type(model).__name__}")
        check_stageable(model.config, n_stages)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_stages:
            raise ValueError(f"index must be an int in [0, {n_stages}), got {index!r}")
        self.config = model.config
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        layers = split_layers(model.config.n_layers, n_stages)[index]
        self.layer_ids = tuple(layers)
        self.embed = model.embed if self.is_first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if self.is_last else None
        self.head = model.head if self.is_last else None

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: ``(input_ids [B, T] int64,)``; others: ``(h [B, T, D], aux 0-d fp32)``.

        Returns:
            ``(h [B, T, D], aux)``, or ``(logits [B, T, V], aux)`` on the last stage.
        """
        if self.is_first:
            (input_ids,) = inputs
            h = self.embed(input_ids)  # [B, T, D]
            aux = torch.zeros((), dtype=torch.float32, device=h.device)
        else:
            h, aux = inputs
        cfg = self.config
        freqs = _rope_freqs(h.shape[1], cfg.qk_rope_head_dim, cfg.rope_theta, h.device)
        for layer in self.layers:
            h, a = layer(h, freqs)
            if a is not None:
                aux = aux + a
        if self.is_last:
            h = self.head(self.norm(h))  # [B, T, V]
        return h, aux

    def loss(
        self, logits: torch.Tensor, aux: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total, lm_loss)``: fp32 ``lm_loss + aux`` and the cross-entropy of ``logits
        [B, T, V]`` against ``labels [B, T]`` (``-100`` ignored), as :class:`DeepSeekV3` computes
        them for one batch."""
        lm_loss = _cross_entropy(logits, labels)
        return lm_loss + aux, lm_loss
