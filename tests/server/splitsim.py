"""Simulate one tensor split into row-block parts, each stepped by its own "shard".

Every part runs in its own thread; ``Rendezvous`` is the cross-shard
``reduce``: each part posts its partial, all wait at a barrier (with a
timeout), then every part combines the partials in part order (so all get
bit-identical results) and checks that all posted the same tag and op.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardps.server.optim import PartInfo, ServerOptimizer
from shardps.server.optim.base import Reduce, State

TIMEOUT_S = 30.0


def row_bounds(full_shape: Sequence[int], nparts: int) -> list[tuple[int, int]]:
    """Element ranges of ``nparts`` row blocks (flat ranges for rank <= 1), sizes within one row."""
    full_shape = tuple(full_shape)
    unit = math.prod(full_shape[1:]) if len(full_shape) >= 2 else 1
    rows = math.prod(full_shape) // unit
    cuts = [rows * k // nparts * unit for k in range(nparts + 1)]
    return list(zip(cuts, cuts[1:]))


@dataclass
class Rendezvous:
    """A lockstep reducer over ``nparts`` threads (one per part)."""

    nparts: int
    timeout: float = TIMEOUT_S
    calls: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._barrier = threading.Barrier(self.nparts, timeout=self.timeout)
        self._slots: list[tuple[str, str, torch.Tensor] | None] = [None] * self.nparts

    def abort(self) -> None:
        self._barrier.abort()

    def reducer(self, index: int) -> Reduce:
        def reduce(tag: str, partial: torch.Tensor, op: str) -> torch.Tensor:
            if op not in ("sum", "max"):
                raise ValueError(f"unknown reduce op {op!r}")
            self._slots[index] = (tag, op, partial.detach().clone())
            self._barrier.wait()
            entries = list(self._slots)
            self._barrier.wait()  # everyone has read the slots before any overwrites them
            assert all(e is not None for e in entries)
            keys = {(e[0], e[1], tuple(e[2].shape)) for e in entries}  # type: ignore[index]
            if len(keys) != 1:
                raise AssertionError(f"parts reduced different things at once: {sorted(keys)}")
            out = entries[0][2].clone()  # type: ignore[index]
            for e in entries[1:]:
                out = out + e[2] if op == "sum" else torch.maximum(out, e[2])  # type: ignore[index]
            if index == 0:
                self.calls.append((tag, op))
            return out

        return reduce


class Recorder:
    """``reduce`` for a whole tensor (returns the partial) that logs its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, tag: str, partial: torch.Tensor, op: str) -> torch.Tensor:
        self.calls.append((tag, op))
        return partial


def run_whole(impl: ServerOptimizer, w0: torch.Tensor, grads: Sequence[torch.Tensor]
              ) -> tuple[torch.Tensor, State, list[tuple[str, str]]]:
    """Step the tensor held whole; returns (param, state, reduce calls)."""
    w = w0.clone()
    info = PartInfo(tuple(w.shape), 0, w.numel())
    state = impl.init_state(w, info)
    rec = Recorder()
    for g in grads:
        impl.step(w, g.clone(), state, info, rec)
    return w, state, rec.calls


def run_split(impl: ServerOptimizer, w0: torch.Tensor, grads: Sequence[torch.Tensor],
              bounds: Sequence[tuple[int, int]], timeout: float = TIMEOUT_S
              ) -> tuple[torch.Tensor, list[State], list[tuple[str, str]]]:
    """Step each part of ``w0`` in its own thread, in lockstep through a ``Rendezvous``.

    Returns the parts put back together, each part's state, and the reduce
    calls (tag, op) of part 0.
    """
    full_shape = tuple(w0.shape)
    flat0 = w0.reshape(-1)
    rv = Rendezvous(len(bounds), timeout)
    infos = [PartInfo(full_shape, a, b) for a, b in bounds]
    params = [flat0[a:b].clone().view(info.shape) for (a, b), info in zip(bounds, infos)]
    states: list[State | None] = [None] * len(bounds)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            a, b = bounds[k]
            info = infos[k]
            states[k] = impl.init_state(params[k], info)
            reduce = rv.reducer(k)
            for g in grads:
                impl.step(params[k], g.reshape(-1)[a:b].clone().view(info.shape), states[k], info, reduce)
        except BaseException as e:  # reported to the caller, after waking the others
            errors.append(e)
            rv.abort()

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(bounds))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    if any(th.is_alive() for th in threads):
        rv.abort()
        raise TimeoutError(f"split step did not finish within {timeout} s")
    if errors:
        raise errors[0]
    out = torch.cat([p.reshape(-1) for p in params]).view(full_shape)
    return out, [s for s in states if s is not None], rv.calls
