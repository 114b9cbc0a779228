"""Cross-entropy over logits whose vocabulary is split (a column-parallel head's output), never gathered.

Three all-reduces (Megatron-LM's ``cross_entropy.py``): the max over the vocabulary (for a stable
softmax), the target's logit (held by the one rank whose slice has it), and the sum of the exponentials.
Each rank's slice is ``torch.chunk``'s, so a vocabulary that does not divide by the TP size works: the last
rank's slice is shorter (or empty), and no padded column ever enters the softmax. The backward needs no
communication: each rank's gradient is its slice of ``softmax - one_hot(target)``.
"""

from __future__ import annotations

from typing import Any

import torch

from shardps.protos.slices import chunk_range
from shardps.worker.tp.group import GroupLike, TPGroup, as_group


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: TPGroup, start: int) -> torch.Tensor:
        logits = logits.float()
        n = logits.shape[-1]
        inside = (target >= start) & (target < start + n)
        local = (target - start).masked_fill(~inside, 0)
        if n:
            top = group.all_reduce(logits.max(-1).values, "max")
            shifted = logits - top.unsqueeze(-1)
            picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
            exp = shifted.exp()
            total = exp.sum(-1)
        else:
            top = group.all_reduce(logits.new_full(target.shape, -torch.inf), "max")
            picked = logits.new_zeros(target.shape)
            exp = logits
            total = logits.new_zeros(target.shape)
        group.all_reduce(picked)
        group.all_reduce(total)
        ctx.save_for_backward(exp / total.unsqueeze(-1), inside, local)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, inside, local = ctx.saved_tensors
        g = softmax.clone()
        if g.shape[-1]:
            g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: GroupLike = None, *,
                                 vocab: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., V_rank)``: this rank's ``torch.chunk`` slice of a vocabulary of
    ``vocab``) against ``target`` (``(...)``, ids in ``[0, vocab)``), equal to ``F.cross_entropy`` of the
    whole logits. ``reduction``: "mean", "sum" or "none" (per position). ``vocab`` None: learnt from the
    slices' sizes (one more all-reduce)."""
    g = as_group(group, "vocab_parallel_cross_entropy: group")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be mean, sum or none, got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
    if vocab is None:
        width = g.all_reduce(torch.tensor([logits.shape[-1]], dtype=torch.int64), "max")
        start = g.rank * int(width)
    else:
        start, end = chunk_range(vocab, g.size, g.rank)
        if end - start != logits.shape[-1]:
            raise ValueError(f"vocab_parallel_cross_entropy: rank {g.rank} of {g.size} holds vocabulary "
                             f"[{start}, {end}) of {vocab}: expected {end - start} logits, got {logits.shape[-1]}")
    losses: torch.Tensor = _VocabParallelCE.apply(logits, target, g, start)  # type: ignore[no-untyped-call]
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()
