"""The interface every server-side optimizer implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

State = dict[str, torch.Tensor]


class ServerOptimizer(ABC):
    """Steps one tensor part in place. Not thread-safe: the store holds its lock.

    ``init_state`` receives the part with its shape (a row block keeps the
    trailing dims), so optimizers with per-row/column state can size it;
    those declare ``elementwise = False`` on their spec and are kept whole.
    """

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    @abstractmethod
    def init_state(self, param: torch.Tensor) -> State: ...

    @abstractmethod
    def step(self, param: torch.Tensor, grad: torch.Tensor, state: State) -> None: ...


def state_bytes(state: State) -> int:
    """Bytes held by an optimizer state (scalars such as the step count included)."""
    return sum(t.numel() * t.element_size() for t in state.values())
