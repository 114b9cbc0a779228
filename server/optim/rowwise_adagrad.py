"""Row-wise Adagrad on row tables, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (no weight decay).

One float of state per row: ``s += mean(g**2)`` over the row, then
``w -= lr / (sqrt(s) + eps) * g``. A row's state is its own: untouched rows
keep theirs.
"""

from __future__ import annotations

import torch

from shardps.protos import optim as specs
from shardps.server.optim.rowbase import RowOptimizer, RowState


class RowwiseAdagradImpl(RowOptimizer):
    spec: specs.RowwiseAdagrad

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"sum": ()}

    def step(self, weights: torch.Tensor, state: RowState, slots: torch.Tensor, grads: torch.Tensor,
             step: int) -> None:
        if len(slots) == 0:
            return
        s = state["sum"][slots] + grads.pow(2).mean(dim=1)
        state["sum"][slots] = s
        multiplier = self.spec.lr / (s.sqrt() + self.spec.eps)
        weights.index_add_(0, slots, -(multiplier[:, None] * grads))
