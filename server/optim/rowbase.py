"""The interface of a row table's optimizer, and plain SGD on rows.

A row optimizer steps the rows at ``slots`` of a table's weights in place,
given one gradient row per slot (the slots distinct: duplicates were summed
before, as ``torch.Tensor.coalesce`` does) and the table's step count (this
step included). Its state is a dict of tensors with one leading row per
slot, grown by the table beside the weights (``state_shapes``); rows not in
``slots`` are never read or written. Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shardps.protos import optim as specs

RowState = dict[str, torch.Tensor]


class RowOptimizer(ABC):
    def __init__(self, spec: specs.OptimizerSpec) -> None:
        specs.check_row_optimizer(spec)
        self.spec = spec

    @abstractmethod
    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """Each state tensor's shape per row (``()``: one float a row)."""

    @abstractmethod
    def step(self, weights: torch.Tensor, state: RowState, slots: torch.Tensor, grads: torch.Tensor,
             step: int) -> None:
        """Update ``weights[slots]`` (and the state's rows at ``slots``) from ``grads`` ([len(slots), dim])."""


class RowSGD(RowOptimizer):
    """``w -= lr * g`` on the touched rows, as ``torch.optim.SGD`` with a sparse gradient and no momentum."""

    spec: specs.SGD

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {}

    def step(self, weights: torch.Tensor, state: RowState, slots: torch.Tensor, grads: torch.Tensor,
             step: int) -> None:
        weights.index_add_(0, slots, grads, alpha=-self.spec.lr)
