"""Token routing of a mixture-of-experts layer (docs/moe.md): top-k, capacity, drops, the balancing loss.

Pure torch, no servers: ``route(probs, top_k, capacity)`` says which expert
each token goes to, with which weight, and which of those assignments are
kept. The rules (Switch Transformer for k = 1, GShard for k = 2):

- each token's k experts are its k largest router probabilities; its
  weight on expert i is ``p_i`` for k = 1, ``p_i`` renormalised over its k
  choices for k >= 2;
- an expert takes at most ``capacity`` assignments; they queue by choice
  rank, then by token position: every token's first choice before any
  second choice (GShard), and within one rank the earlier token first
  (Switch's "by position"). Assignments past the capacity are dropped: the
  token gets nothing from that expert (the layer's caller adds the
  residual). ``capacity=None``: none are dropped (dropless);
- the auxiliary loss is ``E * sum_i f_i * P_i``: ``f_i`` the fraction of
  tokens whose first choice is expert i (before drops), ``P_i`` the mean
  router probability of expert i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Where the T tokens of a batch go. ``expert``/``weight``/``keep``: ``[T, k]``, choice rank in the columns;
    ``weight`` carries the gradient to the router; ``counts``: assignments per expert before drops ([E] int64)."""

    expert: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    counts: torch.Tensor
    aux: torch.Tensor  # E * sum f_i P_i (a scalar, differentiable through the router's probabilities)

    @property
    def dropped(self) -> int:
        """Assignments dropped over capacity."""
        return int((~self.keep).sum())

    def active(self) -> torch.Tensor:
        """The distinct experts that keep at least one assignment, ascending (int64)."""
        active: torch.Tensor = torch.unique(self.expert[self.keep])
        return active

    def tokens_of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens kept by ``expert``, ascending; the choice rank of each)."""
        tok, rank = torch.nonzero((self.expert == expert) & self.keep, as_tuple=True)
        return tok, rank


def capacity(tokens: int, num_experts: int, top_k: int, factor: float, min_capacity: int) -> int:
    """Assignments one expert takes: ``ceil(k * T / E * factor)``, at least ``min_capacity`` (DeepSpeed's)."""
    return max(min_capacity, math.ceil(top_k * tokens / num_experts * factor))


def route(probs: torch.Tensor, top_k: int, cap: int | None) -> Routing:
    """Route ``probs`` ([T, E], each row a softmax) to ``top_k`` experts with at most ``cap`` assignments each."""
    num_tokens, num_experts = probs.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    top_p, expert = torch.topk(probs, top_k, dim=-1)
    weight = top_p if top_k == 1 else top_p / top_p.sum(-1, keepdim=True)
    counts = torch.bincount(expert.reshape(-1), minlength=num_experts)
    if cap is None:
        keep = torch.ones_like(expert, dtype=torch.bool)
    else:
        # Queue order: rank-major (all first choices, then all second ...), token order within a rank.
        order = expert.t().reshape(-1)  # [k * T]
        onehot = torch.nn.functional.one_hot(order, num_experts)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in its expert's queue
        keep = (position < cap).view(top_k, num_tokens).t()
    first = torch.bincount(expert[:, 0], minlength=num_experts).to(probs.dtype) / max(1, num_tokens)
    mean_p = probs.mean(0) if num_tokens else probs.sum(0)
    aux = num_experts * (first * mean_p).sum()
    return Routing(expert, weight, keep, counts, aux)
