"""Pipeline stages of a :class:`~ptxtrain.model.deepseek.DeepSeekV3`: the model cut for the
schedules of :mod:`ptxtrain.parallel` (the model package knows nothing of pipelines).

Source: DeepSeek-V3 report §3.2; docs/design.md §5.

The decoder layers are cut into consecutive slices by a *layout*, the decoder layers of every
stage (:mod:`ptxtrain.train.pipeline_layout`); stage 0 also holds the embedding, the last stage
the final norm and the output head. A stage *shares* its submodules with the model it was cut
from (no copy), so a rank can build the whole model from the seed, exactly as the
single-process run does, and hand its stages to a pipeline schedule.

Stage interface (what the schedules in :mod:`ptxtrain.parallel` pass between ranks):

- stage 0 takes ``(input_ids [B, T] int64,)``; every other stage takes ``(h, aux)``;
- every stage but the last returns ``(h [B, T, D] activation dtype, aux)``, the last returns
  ``(logits [B, T, V], aux)``;
- ``aux`` is a 0-d fp32 tensor: the running sum of the MoE sequence-wise balance losses of the
  layers run so far (report §2.1.2, eq. 17-20), 0 when there is none.

:meth:`DeepSeekV3Stage.loss` turns the last stage's outputs into ``lm_loss + aux_loss``, the
model's total loss without MTP. Multi-token prediction and tied embeddings are not supported here
(the MTP module needs the first stage's embedding on the last stage):
:func:`~ptxtrain.train.pipeline_layout.check_stageable` says so.

F&B overlap (DeepSeek-V3 report §3.2.1, DualPipe's overlapped forward and backward chunks):
:meth:`DeepSeekV3Stage.overlapped_forward_backward` is the hook DualPipe / DualPipeV call for
their F&B steps. On CUDA it queues the forward of one micro-batch and the backward of another on
two different streams so the GPU can run them concurrently. Autograd runs every backward op on
the stream its forward op ran on, so the backward cannot be moved to another stream after the
fact; instead the forward goes to the stream the backward's graph is *not* on: the current
stream or one side stream per device, alternating. Each output of a hook forward is tagged with
its stream (:func:`graph_stream`) so a later hook knows where that chunk's graph lives; plain
forwards run on the current stream. On CPU the hook is
:func:`~ptxtrain.parallel.p2p.sequential_forward_backward` (forward, then backward): the very
same ops, so the numerics are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..model.deepseek import DeepSeekV3, lm_cross_entropy, rope_freqs
from ..parallel.p2p import as_tuple, sequential_forward_backward
from .pipeline_layout import check_layout, check_stageable, layer_ranges

# Attribute set on the outputs (and loss) of a forward run by the overlap hook: the CUDA stream
# its autograd graph lives on, so the backward of that chunk knows which stream is busy.
_STREAM_ATTR = "_ptxtrain_graph_stream"
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the hook's second stream


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The overlap hook's second CUDA stream on ``device`` (one per device, made on first use;
    a device without an index means the current one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def graph_stream(t: torch.Tensor) -> torch.cuda.Stream | None:
    """The CUDA stream the autograd graph of ``t`` lives on when the overlap hook's forward made
    it (the current stream or :func:`side_stream`); None for tensors of a plain forward."""
    return getattr(t, _STREAM_ATTR, None)


def _cuda_tensors(*groups) -> list[torch.Tensor]:
    return [
        t
        for group in groups
        for t in group
        if isinstance(t, torch.Tensor) and t.device.type == "cuda"
    ]


__all__ = ["DeepSeekV3Stage", "graph_stream", "side_stream"]


class DeepSeekV3Stage(nn.Module):
    """Stage ``index`` of ``model`` cut by ``layout`` (shares its submodules; see the module doc).

    Args:
        model: the full model the stage is cut from.
        index: ``0 <= index < len(layout)``.
        layout: decoder layers per stage, in stage order, adding up to ``model.config.n_layers``
            (:func:`~ptxtrain.train.pipeline_layout.check_layout`; e.g.
            :func:`~ptxtrain.train.pipeline_layout.even_layout`).

    Raises:
        TypeError: ``model`` is not a :class:`DeepSeekV3`, or ``layout`` not a list or tuple of
            ints.
        ValueError: ``index`` out of range, a bad ``layout``, or a model that cannot be cut
            (:func:`~ptxtrain.train.pipeline_layout.check_stageable`).
    """

    def __init__(self, model: DeepSeekV3, index: int, layout: Sequence[int]) -> None:
        super().__init__()
        if not isinstance(model, DeepSeekV3):
            raise TypeError(f"model must be a DeepSeekV3, got {type(model).__name__}")
        layout = check_layout(layout, model.config.n_layers)
        n_stages = len(layout)
        check_stageable(model.config, n_stages)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_stages:
            raise ValueError(f"index must be an int in [0, {n_stages}), got {index!r}")
        self.config = model.config
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        layers = layer_ranges(layout)[index]
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
        freqs = rope_freqs(h.shape[1], cfg.qk_rope_head_dim, cfg.rope_theta, h.device)
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
        lm_loss = lm_cross_entropy(logits, labels)
        return lm_loss + aux, lm_loss

    @classmethod
    def overlapped_forward_backward(
        cls,
        module_f: DeepSeekV3Stage,
        inputs_f: tuple,
        criterion_f: Callable | None,
        labels_f: tuple,
        module_b: DeepSeekV3Stage,
        loss_b: torch.Tensor | None,
        outputs_b: Sequence[torch.Tensor],
        output_grads_b: Sequence[torch.Tensor],
    ) -> tuple[tuple, torch.Tensor | None]:
        """The forward of one micro-batch and the backward of another, overlapped on CUDA.

        The overlap hook of the pipeline schedules (:func:`ptxtrain.parallel.p2p.forward_backward`
        calls it for DualPipe's F&B steps); arguments and results as
        :func:`~ptxtrain.parallel.p2p.sequential_forward_backward`, whose numerics it matches:

        Args:
            module_f: the stage to run forward, on ``inputs_f`` (its positional inputs).
            criterion_f: on the last stage ``criterion_f(*outputs_f, *labels_f) -> loss``,
                else None.
            module_b: the stage to run backward (graph built by an earlier forward).
            loss_b: on the last stage the loss to backward from, else None.
            outputs_b, output_grads_b: the outputs to backward from and their gradients (used
                when ``loss_b`` is None).

        Returns:
            ``(outputs_f, loss_f)``; ``loss_f`` None when ``criterion_f`` is None.

        On CUDA (module docstring): the forward and the backward are queued on two streams
        (the current one and a per-device side stream, the forward on the one the backward's
        graph is not on). The side stream first waits for the current one (received tensors,
        earlier updates); tensors made on one stream and used on the other are
        ``record_stream``-ed; the current stream waits for the side stream at the end, so the
        caller sees the results in stream order. On CPU, or with nothing to backward, it is the
        sequential reference.
        """
        roots = [loss_b] if loss_b is not None else list(outputs_b)
        cuda = _cuda_tensors(inputs_f, roots)
        if not cuda or not roots:
            return sequential_forward_backward(
                module_f, inputs_f, criterion_f, labels_f,
                module_b, loss_b, outputs_b, output_grads_b,
            )  # fmt: skip
        device = cuda[0].device
        main = torch.cuda.current_stream(device)
        side = side_stream(device)
        bwd = graph_stream(roots[0])  # the stream b's graph is on
        if bwd is None:  # built by a plain forward, on the current stream
            bwd = main
        fwd = side if bwd == main else main
        side.wait_stream(main)  # inputs and grads received on main, weights updated on main
        if fwd != main:
            for t in _cuda_tensors(inputs_f):
                t.record_stream(fwd)
        if bwd != main:
            for t in _cuda_tensors(output_grads_b):
                t.record_stream(bwd)

        with torch.cuda.stream(fwd):
            outputs_f = as_tuple(module_f(*inputs_f))
            loss_f = criterion_f(*outputs_f, *labels_f) if criterion_f is not None else None
        made_f = _cuda_tensors(outputs_f, [loss_f])
        for t in made_f:
            setattr(t, _STREAM_ATTR, fwd)

        # The ambient stream of the backward call is the graph's own stream: autograd then
        # syncs nothing with the forward just queued on the other stream.
        with torch.cuda.stream(bwd):
            if loss_b is not None:
                torch.autograd.backward([loss_b])
            else:
                torch.autograd.backward(list(outputs_b), list(output_grads_b))

        main.wait_stream(side)
        if fwd != main:
            for t in made_f:
                t.record_stream(main)
        return outputs_f, loss_f
