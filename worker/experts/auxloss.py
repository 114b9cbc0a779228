"""Extra loss terms a module's forward adds where its caller cannot take them from its outputs.

A layer such as ``shardps.nn.MoE`` returns its balancing loss beside its
output; a model that adds it to its loss itself needs nothing from here. A
pipeline stage cannot: it hands the next stage one tensor, and the loss is
made on the last stage. So a stage runs each micro-batch's forward inside
``collect()``, every ``MoE`` forward adds its balancing loss there
(``add``), and the stage adds their sum, weighted as the micro-batch's loss,
to that micro-batch's backward (worker/pipeline/stage.py). Outside
``collect()``, ``add`` does nothing.

Per thread: a stage's forwards run in its own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


@contextmanager
def collect() -> Iterator[list[torch.Tensor]]:
    """The terms ``add``-ed in this thread while the block runs (an inner ``collect`` takes its own)."""
    stack: list[list[torch.Tensor]] = getattr(_local, "stack", None) or []
    _local.stack = stack
    terms: list[torch.Tensor] = []
    stack.append(terms)
    try:
        yield terms
    finally:
        stack.pop()


def add(term: torch.Tensor) -> None:
    """Add a scalar loss term to the innermost ``collect()`` of this thread; nothing outside one."""
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append(term)


def total(terms: list[torch.Tensor]) -> torch.Tensor | None:
    """The sum of ``terms`` (None when there are none)."""
    if not terms:
        return None
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out
