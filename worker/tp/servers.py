"""A TP group's ranks as parameter-server workers: the servers hold whole tensors under the dense names.

Each rank pushes and pulls its own slices straight to and from the servers (worker/tp/stepper.py): its
slice of each split gradient (the shards put the slices in place and step the whole tensor once every
slice of every data-parallel replica is in) and of each split weight (served along dim 1 too, without
the rest of the rows). A replicated parameter (layer norms, a row-parallel bias: the same gradient on
every rank) has one owner in its group, which alone pushes it (once per TP group); every rank pulls it.
Owners are also who register the initial values: every parameter has one (the largest tensors first,
each to the rank that owns the fewest elements so far), which gathers it whole once, at the start. The
servers' tensors and checkpoints are the dense model's (names and shapes do not depend on the TP size:
train at TP = 2, resume at TP = 1 or 4), and R data-parallel replicas of a TP group are R x p workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from shardps.protos.slices import TensorSlice
from shardps.worker.client import PSClient
from shardps.worker.layout import OptimizerChoice
from shardps.worker.tp.group import GroupLike, Slice, as_group
from shardps.worker.tp.split import tp_slices
from shardps.worker.tp.stepper import TPStepper


def owners(shapes: list[tuple[str, tuple[int, ...]]], size: int) -> dict[str, int]:
    """Each tensor's owning rank: largest first, to the rank with the fewest elements owned (lowest rank on
    a tie); deterministic, so every rank computes the same."""
    load = [0] * size
    out: dict[str, int] = {}
    for name, shape in sorted(shapes, key=lambda ns: (-_numel(ns[1]), ns[0])):
        r = min(range(size), key=lambda k: (load[k], k))
        out[name] = r
        load[r] += max(1, _numel(shape))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class TPOptimizer:
    """The servers' optimizer for one TP rank of a split model (``params``: the module, or its parameters
    by name with ``slices``, ``tp_slices`` of the module, as a pipeline stage's weights hand them over):
    ``step()`` pushes this rank's slices of the gradients (and the replicated ones it owns) and pulls its
    new slices and the replicated tensors; every rank calls each method at the same point (the start is a
    collective over ``group``; a step's barrier is the servers').

    ``client``: this rank's ``PSClient`` (a worker of its own; replica r's rank t is worker ``r * p + t``
    of ``R * p`` in plain data parallelism). ``provides_values``: whether this group's values are the ones
    registered (default: replica 0's, i.e. ``client.worker_id < group.size``). The other arguments are
    ``DistributedOptimizer``'s."""

    def __init__(self, params: nn.Module | Iterable[tuple[str, torch.Tensor]], client: PSClient,
                 group: GroupLike = None, *, slices: Mapping[str, tuple[Slice, tuple[int, ...]]] | None = None,
                 optimizer: OptimizerChoice | None = None, sync: str = "bsp", provides_values: bool | None = None,
                 **options: Any) -> None:
        self.group = g = as_group(group, "TPOptimizer: group")
        if isinstance(params, nn.Module):
            self.split = dict(slices) if slices is not None else tp_slices(params)
            params = params.named_parameters()
        else:
            self.split = dict(slices or {})
        self.params = [(n, p) for n, p in params if p.requires_grad]
        shapes = [(n, self.split[n][1] if n in self.split else tuple(p.shape)) for n, p in self.params]
        if len(shapes) < g.size:
            raise ValueError(f"TPOptimizer: {len(shapes)} parameters cannot give each of {g.size} TP ranks one")
        self.owner = owners(shapes, g.size)
        if provides_values is None:
            provides_values = client.worker_id < g.size
        # The whole tensors this rank owns, registered: gathered once (a collective) where the group's values
        # are the ones registered, their shapes alone ("meta") elsewhere; let go once registered.
        masters: dict[str, nn.Parameter] = {}
        for (n, p), (_, shape) in zip(self.params, shapes):
            if provides_values:
                full = self._whole(n, p.detach())
            else:
                full = torch.empty(shape, dtype=p.dtype, device="meta") if self.owner[n] == g.rank else None
            if full is not None:
                masters[n] = nn.Parameter(full)
        self.owned = sorted(masters)
        # The shard map of the whole model, whichever tensors this rank owns: the same at every TP size.
        client.plan_over = {n: torch.empty(shape, dtype=p.dtype, device="meta")
                            for (n, shape), (_, p) in zip(shapes, self.params)}
        cut = {n: TensorSlice(sl.dim, g.size, g.rank, sl.parts) for n, (sl, _) in self.split.items()}
        owned = {n for n, r in self.owner.items() if r == g.rank and n not in self.split}
        # Registers the masters, then pulls this rank's slices and replicated tensors (every rank starts from
        # the servers' values).
        self.opt = TPStepper(masters, client, local=dict(self.params), slices=cut, plan_over=client.plan_over,
                             pushes=owned, optimizer=optimizer, sync=sync, provides_values=provides_values,
                             **options)

    def _sizes(self, sl: Slice, shape: tuple[int, ...]) -> list[int]:
        return [sl.local_shape(shape, self.group.size, r)[sl.dim] for r in range(self.group.size)]

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor on its owner (None elsewhere), from every rank's ``local`` slice of it."""
        g, owner = self.group, self.owner[name]
        if name not in self.split:
            return local.clone() if g.rank == owner else None
        sl, shape = self.split[name]
        pieces = g.gather_padded(local, sl.dim, self._sizes(sl, shape), owner)
        if pieces is None:
            return None
        full = local.new_empty(shape)
        for r, piece in enumerate(pieces):
            sl.put(full, piece, g.size, r)
        return full

    def step(self) -> None:
        """Push this rank's slices of the gradients (and the replicated ones it owns), then pull its slices
        and the replicated tensors."""
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()
