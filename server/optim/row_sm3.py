"""SM3 on row tables: one accumulator per row, as google-research ``sm3/sm3.py``'s sparse path.

For a sparse gradient of a matrix, SM3-II keeps only the cover set of the
sparse axis (the rows; a column accumulator would grow at every step and
overestimate, as that code's comment explains): for each touched row i
(distinct: duplicates summed before),

    nu_ij = mu_i + g_ij ** 2
    w_ij -= lr * g_ij / sqrt(nu_ij + eps)
    mu_i  = max_j nu_ij

with ``eps`` as the dense SM3 (``protos.optim.SM3``: google-research adds
1e-30; with eps 0 a zero ``nu`` gives no step). Rows not touched keep their
accumulator. One float of state per row. Momentum is refused on a row
table (``check_row_optimizer``): the reference does not apply it to sparse
updates, and dropping it silently is what this project does not do.
"""

from __future__ import annotations

import torch

from shardps.protos import optim as specs
from shardps.server.optim.rowbase import RowOptimizer, RowState


class RowSM3Impl(RowOptimizer):
    spec: specs.SM3

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"accumulator": ()}

    def step(self, weights: torch.Tensor, state: RowState, slots: torch.Tensor, grads: torch.Tensor,
             step: int) -> None:
        if len(slots) == 0:
            return
        acc = state["accumulator"]
        nu = grads.square().add_(acc[slots][:, None])
        denom = nu + self.spec.eps
        update = grads * denom.rsqrt()
        if self.spec.eps == 0:
            update = torch.where(denom > 0, update, torch.zeros_like(update))
        acc[slots] = nu.amax(dim=1)
        weights.index_add_(0, slots, update, alpha=-self.spec.lr)
