"""``Stream``: the settings of a streamed model, and the pure parts of its plan.

``DistributedOptimizer(model, client, stream=shardps.Stream(max_live_bytes))``
keeps only the weights of the modules in use (``worker/streaming/streamer.py`` runs it).
What lives here has no threads and no network, and is tested as tables
(``tests/worker/test_streamplan.py``):

- ``Stream``: the user's settings, validated;
- ``units``: the model cut at ``nn.Module`` boundaries, each unit the names
  of the parameters its forward uses (a weight tied between two modules is
  in both: fetched for each use);
- ``schedule``: the order the units' weights are needed in, forward calls
  first, then their backward in reverse: prefetching walks it. It is made
  from the calls the first forward recorded, never from registration order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

KEEPS = ("server", "host")


@dataclass(frozen=True)
class Stream:
    """Stream a model's weights from the servers, module by module (docs/streaming.md).

    ``max_live_bytes``: the parameter + gradient storage a worker holds at
    once is kept under it (plus one unit, the largest, and its gradients:
    a unit must be whole to run). ``prefetch``: how many units ahead the
    pulls run (0: each unit waits for its own). ``keep``: where a weight
    comes back from for backward, ``"server"`` (pulled again) or ``"host"``
    (a copy kept in host memory at forward: for a GPU worker, the offload).
    ``modules``: the units, named by the user (each a module of the model;
    its parameters, its children's included, come and go together); the
    modules with parameters of their own outside them are units too. None:
    every module with parameters of its own is a unit.
    """

    max_live_bytes: int
    prefetch: int = 1
    keep: str = "server"
    modules: Sequence[nn.Module] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_live_bytes, bool) or not isinstance(self.max_live_bytes, int):
            raise ValueError(f"Stream: max_live_bytes must be an int (bytes), got {self.max_live_bytes!r}")
        if self.max_live_bytes < 0:
            raise ValueError(f"Stream: max_live_bytes must be >= 0, got {self.max_live_bytes}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Stream: prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.keep not in KEEPS:
            raise ValueError(f"Stream: keep must be one of {KEEPS}, got {self.keep!r}")


@dataclass(frozen=True)
class Unit:
    """One streamed piece: a module and the names of the parameters its forward uses."""

    module: nn.Module
    names: tuple[str, ...]
    nbytes: int  # the weights' storage bytes


def units(model: nn.Module, params: Mapping[str, torch.Tensor], chosen: Sequence[nn.Module] | None) -> list[Unit]:
    """The model cut into units (see the module docstring), in registration order; every parameter in
    ``params`` is in at least one. Raises ValueError for a chosen module not in the model, or inside another."""
    by_id = {id(p): n for n, p in params.items()}
    mods = list(model.modules())
    ids = {id(m) for m in mods}
    chosen = list(chosen or ())
    for m in chosen:
        if id(m) not in ids:
            raise ValueError(f"Stream(modules=...): {type(m).__name__} is not a module of the model")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)):
            raise ValueError(f"Stream(modules=...): a {type(m).__name__} has no forward to hook: name the "
                             f"modules in it")
    inside: set[int] = set()  # modules within a chosen one
    for m in chosen:
        for sub in m.modules():
            if sub is not m:
                if any(sub is c for c in chosen):
                    raise ValueError(f"Stream(modules=...): {type(sub).__name__} is inside "
                                     f"{type(m).__name__}, also named: name one of them")
                inside.add(id(sub))
    out: list[Unit] = []
    for m in mods:
        if any(m is c for c in chosen):
            names = _names(m.parameters(), by_id)
        elif id(m) in inside:
            continue
        else:
            names = _names(m.parameters(recurse=False), by_id)
        if names:
            out.append(Unit(m, names, sum(_nbytes(params[n]) for n in names)))
    return out


def _names(ps: object, by_id: Mapping[int, str]) -> tuple[str, ...]:
    seen: list[str] = []
    for p in ps:  # type: ignore[attr-defined]
        n = by_id.get(id(p))
        if n is not None and n not in seen:
            seen.append(n)
    return tuple(seen)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


Slot = tuple[str, int]  # ("f", k): the k-th call's forward; ("b", k): its backward; ("e", -d): an evaluation's


def schedule(calls: int) -> list[Slot]:
    """The slots of a step whose forward made ``calls`` unit calls: each forward in order, then each
    backward in reverse (the order autograd runs a chain in)."""
    return [("f", k) for k in range(calls)] + [("b", k) for k in reversed(range(calls))]


def ahead(plan: Sequence[Slot], at: Slot, prefetch: int) -> list[Slot]:
    """The ``prefetch`` slots after ``at`` in ``plan`` (fewer at its end; none if ``at`` is not in it)."""
    try:
        i = plan.index(at)
    except ValueError:
        return []
    return list(plan[i + 1 : i + 1 + prefetch])


def fits(live: int, more: int, budget: int) -> bool:
    """Whether ``more`` bytes may be prefetched with ``live`` held under ``budget``."""
    return live + more <= budget
