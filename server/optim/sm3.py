"""SM3-II, step for step as google-research ``sm3/sm3.py``, whole or split by rows.

Rank k >= 2, one accumulator mu_i of size n_i per axis:
nu = min_i mu_i[index_i] + g^2 (broadcast), then mu_i = max of nu over every
axis but i. Rank <= 1: Adagrad, nu = mu = mu + g^2.
u = g / sqrt(nu + eps); momentum m > 0: gbar = m gbar + (1 - m) u, theta -= lr gbar;
else theta -= lr u.

Split tensors. A part is a block of rows (dim 0). nu is elementwise given the
accumulators, and mu_0 (one value per row) is a max over the part's own rows,
so both stay local. mu_1..mu_{k-1} are maxes over dim 0 too, so the part's
partial maxes go through ``reduce("sm3.accumulators", cat(mu_1..mu_{k-1}), "max")``
once per step (rank >= 2 only; rank <= 1 is elementwise and never reduces).
Every part holds mu_1..mu_{k-1} whole and identical.

State per part: ``step`` (0-d), ``accumulator_0`` .. ``accumulator_{k-1}``
(rank >= 2; ``accumulator_0`` has the part's rows) or ``accumulator`` (rank
<= 1, the part's shape), and ``momentum`` (the part's shape) when m > 0.
"""

from __future__ import annotations

import math

import torch

from shardps.protos.optim import SM3
from shardps.server.optim.base import (
    PartInfo,
    Reduce,
    ServerOptimizer,
    State,
    check_row_block,
    local_reduce,
)


def _bshape(rank: int, i: int, n: int) -> list[int]:
    return [1] * i + [n] + [1] * (rank - i - 1)


def _amax_but(x: torch.Tensor, i: int) -> torch.Tensor:
    """Max of ``x`` over every axis but ``i``; zeros where the part is empty (nu >= 0)."""
    dims = [d for d in range(x.dim()) if d != i]
    if x.numel() == 0:
        return torch.zeros(x.shape[i], dtype=x.dtype, device=x.device)
    return torch.amax(x, dim=dims)


class SM3Impl(ServerOptimizer):
    spec: SM3

    def init_state(self, param: torch.Tensor, part: PartInfo) -> State:
        check_row_block("sm3", param, part)
        state: State = {"step": torch.zeros((), dtype=torch.float32)}
        if param.dim() >= 2:
            for i, n in enumerate(param.shape):
                state[f"accumulator_{i}"] = torch.zeros(n, dtype=torch.float32, device=param.device)
        else:
            state["accumulator"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        if self.spec.momentum > 0:
            state["momentum"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return state

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: State, part: PartInfo,
             reduce: Reduce = local_reduce) -> None:
        s = self.spec
        check_row_block("sm3", param, part)
        state["step"] += 1
        if math.prod(part.full_shape) == 0:
            return
        rank = param.dim()
        if rank >= 2:
            accs = [state[f"accumulator_{i}"] for i in range(rank)]
            nu = accs[0].view(_bshape(rank, 0, accs[0].numel()))
            for i in range(1, rank):
                nu = torch.minimum(nu, accs[i].view(_bshape(rank, i, accs[i].numel())))
            nu = nu.expand(param.shape).addcmul(grad, grad)
            accs[0].copy_(_amax_but(nu, 0))
            partial = torch.cat([_amax_but(nu, i) for i in range(1, rank)])
            total = reduce("sm3.accumulators", partial, "max")
            for acc, new in zip(accs[1:], torch.split(total, [a.numel() for a in accs[1:]])):
                acc.copy_(new)
        else:
            nu = state["accumulator"]
            nu.addcmul_(grad, grad)

        denom = nu + s.eps
        update = grad * denom.rsqrt()
        if s.eps == 0:
            # google-research adds 1e-30; with eps 0, a zero accumulator gives no step.
            update = torch.where(denom > 0, update, torch.zeros_like(update))
        if s.momentum > 0:
            gbar = state["momentum"]
            gbar.mul_(s.momentum).add_(update, alpha=1.0 - s.momentum)
            update = gbar
        param.add_(update, alpha=-s.lr)
