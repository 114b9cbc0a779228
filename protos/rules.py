"""Per-tensor optimizer choice: ``Rules([("*.bias", Adam()), (min_rank(2), Adafactor())], default=Adam())``.

A ``Rules`` object is the callable ``(name, tensor) -> OptimizerSpec`` that
``DistributedOptimizer(optimizer=...)`` and ``PSClient.register`` accept. The
first rule that matches wins; a match is a glob on the parameter name
(``fnmatch``: ``"*.bias"``, ``"*norm*"``) or a predicate ``(name, tensor) -> bool``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

from shardps.protos.optim import OptimizerSpec

Match = str | Callable[[str, Any], bool]


def min_rank(rank: int) -> Callable[[str, Any], bool]:
    """Matches tensors with at least ``rank`` dimensions (``min_rank(2)``: matrices and up)."""

    def match(name: str, tensor: Any) -> bool:
        return len(tuple(tensor.shape)) >= rank

    match.__name__ = f"min_rank({rank})"
    return match


def max_rank(rank: int) -> Callable[[str, Any], bool]:
    """Matches tensors with at most ``rank`` dimensions (``max_rank(1)``: biases, norms)."""

    def match(name: str, tensor: Any) -> bool:
        return len(tuple(tensor.shape)) <= rank

    match.__name__ = f"max_rank({rank})"
    return match


class Rules:
    def __init__(self, rules: Sequence[tuple[Match, OptimizerSpec]], default: OptimizerSpec) -> None:
        for i, (m, spec) in enumerate(rules):
            if not (isinstance(m, str) or callable(m)):
                raise TypeError(f"rule {i}: match must be a glob string or a callable, got {type(m).__name__}")
            if not isinstance(spec, OptimizerSpec):
                raise TypeError(f"rule {i}: expected an optimizer spec, got {type(spec).__name__}")
        if not isinstance(default, OptimizerSpec):
            raise TypeError(f"default: expected an optimizer spec, got {type(default).__name__}")
        self.rules = list(rules)
        self.default = default

    def __call__(self, name: str, tensor: Any) -> OptimizerSpec:
        for m, spec in self.rules:
            if (fnmatch.fnmatchcase(name, m) if isinstance(m, str) else m(name, tensor)):
                return spec
        return self.default

    def describe(self, named: Sequence[tuple[str, Any]]) -> dict[str, str]:
        """Which optimizer each named tensor gets: for logs and checks."""
        return {n: self(n, t).name for n, t in named}
