"""SparseAdam on row tables: ``torch.optim.SparseAdam``'s update, line for line.

The moments of rows not touched keep their values (not decayed), the step
count is the table's (one per push of the table, on every shard, touched or
not, as torch counts every ``step()`` whose gradient is not None), and the
arithmetic follows ``torch.optim._functional.sparse_adam`` in its order, so
touched rows agree with torch to rounding and untouched ones bit for bit.
"""

from __future__ import annotations

import math

import torch

from shardps.protos import optim as specs
from shardps.server.optim.rowbase import RowOptimizer, RowState


class SparseAdamImpl(RowOptimizer):
    spec: specs.SparseAdam

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"exp_avg": (dim,), "exp_avg_sq": (dim,)}

    def step(self, weights: torch.Tensor, state: RowState, slots: torch.Tensor, grads: torch.Tensor,
             step: int) -> None:
        if len(slots) == 0:
            return
        beta1, beta2 = self.spec.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        old_exp_avg = exp_avg[slots]
        exp_avg_update = grads.sub(old_exp_avg).mul_(1 - beta1)
        exp_avg.index_add_(0, slots, exp_avg_update)
        old_exp_avg_sq = exp_avg_sq[slots]
        exp_avg_sq_update = grads.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2)
        exp_avg_sq.index_add_(0, slots, exp_avg_sq_update)
        numer = exp_avg_update.add_(old_exp_avg)
        exp_avg_sq_update.add_(old_exp_avg_sq)
        denom = exp_avg_sq_update.sqrt_().add_(self.spec.eps)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = self.spec.lr * math.sqrt(bias_correction2) / bias_correction1
        weights.index_add_(0, slots, -step_size * numer.div_(denom))
