"""Per-tensor choices: ``Rules([("*.bias", Adam()), (min_rank(2), Adafactor())], default=Adam())``.

A ``Rules`` object is the callable ``(name, tensor) -> spec`` that
``DistributedOptimizer(optimizer=...)`` and ``PSClient.register`` accept
(optimizer specs), and ``DistributedOptimizer(compress=...)`` (compression
specs, ``shardps.compress``: ``Rules([("embed.*", Dense())], default=TopK(0.01))``).
The first rule that matches wins; a match is a glob on the parameter name
(``fnmatch``: ``"*.bias"``, ``"*norm*"``) or a predicate ``(name, tensor) -> bool``.
Every spec of one ``Rules`` is of the default's kind: an ``OptimizerSpec``, or
a spec whose class says its ``rule_kind`` (``"compression"``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from shardps.protos.optim import OptimizerSpec

Match = str | Callable[[str, Any], bool]
S = TypeVar("S")


def rule_kind(spec: Any) -> str | None:
    """What a spec chooses ("optimizer", "compression"...), None for anything that is no spec."""
    return "optimizer" if isinstance(spec, OptimizerSpec) else getattr(type(spec), "rule_kind", None)


def _a(kind: str | None) -> str:
    return f"an {kind} spec" if kind and kind[0] in "aeiou" else f"a {kind} spec"


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


class Rules(Generic[S]):
    def __init__(self, rules: Sequence[tuple[Match, S]], default: S) -> None:
        kind = rule_kind(default)
        for i, (m, spec) in enumerate(rules):
            if not (isinstance(m, str) or callable(m)):
                raise TypeError(f"rule {i}: match must be a glob string or a callable, got {type(m).__name__}")
            if rule_kind(spec) != (kind or "optimizer"):
                raise TypeError(f"rule {i}: expected {_a(kind or 'optimizer')}, got {type(spec).__name__}")
        if kind is None:
            raise TypeError(f"default: expected an optimizer or a compression spec, got {type(default).__name__}")
        self.rules = list(rules)
        self.default = default

    def __call__(self, name: str, tensor: Any) -> S:
        for m, spec in self.rules:
            if (fnmatch.fnmatchcase(name, m) if isinstance(m, str) else m(name, tensor)):
                return spec
        return self.default

    def describe(self, named: Sequence[tuple[str, Any]]) -> dict[str, str]:
        """Which spec (its name) each named tensor gets: for logs and checks."""
        return {n: getattr(self(n, t), "name", str(self(n, t))) for n, t in named}
