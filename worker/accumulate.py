"""``Accumulator``: the gradients of ``every:X``'s local steps, summed until the step that pushes.

Owned by ``DistributedOptimizer`` (``step()`` adds a step's gradients and
pushes their mean on the X-th call); the overlap hooks read it
(``worker/overlap.py``) to stream the X-th step's mean during its backward.
Not thread-safe: the training thread (and the autograd hooks it runs) only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class Accumulator:
    """Sums of gradients over ``steps`` local steps (nothing held: ``steps == 0``)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self.steps = 0

    def add(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one local step's gradients (copied the first time a tensor is seen, summed in place after)."""
        for n, g in grads.items():
            acc = self._sums.get(n)
            if acc is None:
                self._sums[n] = g.detach().clone()
            else:
                acc.add_(g)
        self.steps += 1

    def add_one(self, name: str, grad: torch.Tensor) -> None:
        """Add one tensor's gradient of the step being taken, ``steps`` unchanged (a streamed model hands
        each in as backward completes it; ``add({})`` then counts the step)."""
        acc = self._sums.get(name)
        if acc is None:
            self._sums[name] = grad.detach().clone()
        else:
            acc.add_(grad)

    def mean(self) -> dict[str, torch.Tensor]:
        """The mean over the steps held (the sums divided in place) and forget them: the gradient to push."""
        grads = {n: a.div_(self.steps) for n, a in self._sums.items()}
        self.reset()
        return grads

    def reset(self) -> None:
        """Forget what is held (a pushed or abandoned accumulation, a rollback)."""
        self._sums, self.steps = {}, 0

    def sum_of(self, name: str) -> torch.Tensor | None:
        """``name``'s sum so far (None: no step held a gradient for it). Not a copy: do not change it."""
        return self._sums.get(name)

    def mean_with(self, name: str, grad: torch.Tensor | None, every: int) -> torch.Tensor:
        """What goes up for ``name`` on the pushing step of ``every:X`` whose own gradient is ``grad``: the
        sum so far plus ``grad``, over ``every`` (a new tensor; at least one of the two must exist)."""
        acc = self._sums.get(name)
        if acc is None:
            assert grad is not None
            return grad.detach() / every
        return (acc + grad if grad is not None else acc) / every
