"""Validation loss and end-of-run samples of ``ptxtrain train``, on one process or collectively
over an expert-parallel group (each rank runs its share of the sequences)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..data import ByteTokenizer, Corpus, batch_generator

if TYPE_CHECKING:
    from .args import TrainArgs

__all__ = [
    "SAMPLE_COUNT",
    "SAMPLE_PROMPT",
    "SAMPLE_TEMPERATURE",
    "all_reduce_mean",
    "evaluate",
    "sample_texts",
    "shard_rows",
]

SAMPLE_PROMPT = "\n"
SAMPLE_COUNT = 3
SAMPLE_TEMPERATURE = 0.8


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, corpus: Corpus, args: TrainArgs, device: torch.device
) -> float:
    """Mean next-token loss (nats/byte) over ``eval_batches`` fixed validation batches.

    Validation batch ``i`` is ``batch_size * grad_accum_steps`` sequences drawn with
    ``batch_generator(seed, i, "val")`` (the same bytes every time, so successive values are
    comparable), run in micro-batches of ``batch_size`` as training runs them. With expert
    parallelism (``model.ep_size > 1``) every rank of the group must call this: each evaluates
    its ``1/ep`` share of every micro-batch and the result, averaged over the group, is the same
    on every rank.
    """
    was_training = model.training
    model.eval()
    ep = getattr(model, "ep_size", 1)
    rank = _group_rank(model.ep_group) if ep > 1 else 0
    total = 0.0
    n = args.grad_accum_steps
    for i in range(args.eval_batches):
        x, y = corpus.get_batch(
            "val", args.batch_size * n, args.seq_len, batch_generator(args.seed, i, "val")
        )
        for xm, ym in zip(x.split(args.batch_size), y.split(args.batch_size), strict=True):
            out = model(shard_rows(xm, rank, ep).to(device), shard_rows(ym, rank, ep).to(device))
            total += float(out.lm_loss)
    model.train(was_training)
    if ep > 1:
        total = all_reduce_mean([total], model.ep_group, device)[0]
    return total / (args.eval_batches * n)


def _group_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def shard_rows(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows ``[rank·B/n, (rank+1)·B/n)`` of ``t [B, ...]`` (``n`` divides ``B``)."""
    per = t.shape[0] // n
    return t[rank * per : (rank + 1) * per]


def all_reduce_mean(values: list[float], group, device: torch.device) -> list[float]:
    """The mean of each value over the ranks of ``group`` (float64, one all-reduce on
    ``device``, which must suit the group's backend)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def sample_texts(model: torch.nn.Module, args: TrainArgs, device: torch.device) -> list[str]:
    """``SAMPLE_COUNT`` texts of ``args.sample_tokens`` bytes each, sampled after
    ``SAMPLE_PROMPT`` at ``SAMPLE_TEMPERATURE`` with a generator seeded by ``args.seed``. With
    expert parallelism every rank of the group must call this (the forward is a collective)."""
    from ..model import generate

    tok = ByteTokenizer()
    prompt = tok.encode(SAMPLE_PROMPT).to(device)
    prompt = prompt[None, :].expand(SAMPLE_COUNT, -1).contiguous()  # [B, T0]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = generate(
            model, prompt, args.sample_tokens, temperature=SAMPLE_TEMPERATURE, generator=gen
        )
    model.train(was_training)
    return [tok.decode(row) for row in ids[:, prompt.shape[1] :].cpu()]
