"""The interface every server-side optimizer implements."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardps.protos.shardmap import part_shape

State = dict[str, torch.Tensor]

#: ``reduce(tag, partial, op)`` combines a statistic over every part of a
#: tensor: ``op`` is "sum" or "max", ``tag`` names the statistic (the same on
#: every part, so split tensors can match them up). For a tensor held whole
#: it returns ``partial`` itself.
Reduce = Callable[[str, torch.Tensor, str], torch.Tensor]


def local_reduce(tag: str, partial: torch.Tensor, op: str) -> torch.Tensor:
    """The reduction for a tensor held whole by one shard: nothing to combine."""
    return partial


@dataclass(frozen=True)
class PartInfo:
    """Which piece of a tensor a shard steps: elements [start, stop) of ``full_shape``."""

    full_shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        return part_shape(self.full_shape, self.start, self.stop)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == math.prod(self.full_shape)


class ServerOptimizer(ABC):
    """Steps one tensor part in place. Not thread-safe: the store holds its lock.

    ``param`` and ``grad`` have the part's shape (a row block keeps the
    trailing dims). Elementwise optimizers ignore ``part`` and ``reduce``;
    optimizers with row/column or tensor-wide statistics compute their local
    partial sums and pass them through ``reduce``, so the same code gives
    the same result whether the tensor is whole or split across shards.
    """

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    @abstractmethod
    def init_state(self, param: torch.Tensor, part: PartInfo) -> State: ...

    @abstractmethod
    def step(self, param: torch.Tensor, grad: torch.Tensor, state: State, part: PartInfo,
             reduce: Reduce = local_reduce) -> None: ...

    def step_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, State, PartInfo]]) -> None:
        """Step several whole-or-elementwise parts at once (a multi-tensor kernel if there is one)."""
        for param, grad, state, part in items:
            self.step(param, grad, state, part)

    def takes_slices(self) -> bool:
        """Whether ``step_many`` may be given slices of a part instead of the part (see ``split_state``).

        Then several items may cover one part, each with its own slice of the weight, the gradient and
        the per-element state, sharing the part's scalar state (a step count), which ``step_many`` must
        advance once per part however many slices it gets. Elementwise optimizers only.
        """
        return False

    def split_state(self, state: State, sizes: Sequence[int]) -> list[State]:
        """A part's state cut as ``torch.split`` cuts its flat weight: per-element tensors split, scalars shared."""
        split = {k: torch.split(v.view(-1), list(sizes)) for k, v in state.items() if v.dim()}
        return [{k: split[k][i] if k in split else v for k, v in state.items()} for i in range(len(sizes))]


def check_row_block(name: str, param: torch.Tensor, part: PartInfo) -> None:
    """ValueError unless ``part`` is whole rows of its tensor and ``param`` has the part's shape.

    For optimizers whose statistics run along rows and columns (Adafactor, SM3).
    """
    if len(part.full_shape) >= 2 and part.shape[1:] != tuple(part.full_shape[1:]):
        raise ValueError(
            f"{name} needs whole rows of a rank-{len(part.full_shape)} tensor; part "
            f"[{part.start}, {part.stop}) of {tuple(part.full_shape)} is not a row block")
    if tuple(param.shape) != part.shape:
        raise ValueError(f"{name}: param shape {tuple(param.shape)} is not the part's shape {part.shape}")


def state_bytes(state: State) -> int:
    """Bytes held by an optimizer state (scalars such as the step count included)."""
    return sum(t.numel() * t.element_size() for t in state.values())
