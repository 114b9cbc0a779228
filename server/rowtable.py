"""One row table's rows on a shard: storage, first touch, admission, expiry, versions (docs/sparse.md).

A ``RowTable`` keeps its rows in one fp32 tensor ``[capacity, dim]`` that
doubles when full, a dict from key to row slot, per slot its key, last step
and version, and its optimizer's state beside the rows
(server/optim/rowbase.py). Not thread-safe: ``RowTables`` (server/rows.py)
holds the lock over every call.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from shardps.protos.rows import RowTableSpec, init_rows
from shardps.server.optim import RowOptimizer

INITIAL_CAPACITY = 1024
#: What a table counts (``RowTable.counts``; the metrics and Stats show them).
COUNTS = ("admitted", "dropped", "expired", "duplicates", "skipped")


@dataclass
class RowTable:
    """One table's rows on this shard.

    Admission (``spec.admit`` > 1): a key not held is counted in ``seen`` at each push that carries it;
    its gradients are dropped (``dropped``) until the push that makes the count ``admit``, which creates
    the row and applies that push (``admitted``); a pull of it reads its init and stores nothing.
    Expiry (``spec.expire`` > 0): after each step, rows not pushed for more than ``expire`` of the table's
    steps are dropped (``expired``); touched again, they start from their init.
    """

    spec: RowTableSpec
    optimizer: RowOptimizer
    weights: torch.Tensor = field(init=False)
    state: dict[str, torch.Tensor] = field(init=False)
    slots: dict[int, int] = field(default_factory=dict)  # key (uint64 as int) -> row of ``weights``
    steps: int = 0  # pushes applied (the optimizer's step count: one per push, touched or not)
    # bsp: step -> worker -> (keys, gradients, skip: an inf/nan in them)
    held: dict[int, dict[int, tuple[np.ndarray, torch.Tensor, bool]]] = field(default_factory=dict)
    bsp_done: int = -1  # the last bsp step applied
    seen: dict[int, int] = field(default_factory=dict)  # admission: pushes that carried each key not held
    counts: dict[str, int] = field(default_factory=dict)
    pushed: dict[int, int] = field(default_factory=dict)  # asp: worker -> the last step of its applied
    skipped_steps: set[int] = field(default_factory=set)  # the newest steps skipped (inf/nan): answers to retries

    def __post_init__(self) -> None:
        self.counts = {**dict.fromkeys(COUNTS, 0), **self.counts}
        self.weights = torch.empty(0, self.spec.dim)
        self.state = {k: torch.zeros(0, *shape) for k, shape in self.optimizer.state_shapes(self.spec.dim).items()}
        self.last = torch.zeros(0, dtype=torch.int64)  # per slot: the table step that last pushed (or made) it
        self.updates = torch.zeros(0, dtype=torch.int64)  # per slot: the row's version (optimizer steps on it)
        self.staleness: Counter[int] = Counter()  # per pushed row: steps that updated it since the worker's pull
        self.keys = np.zeros(0, dtype=np.uint64)  # per slot: its key

    @property
    def size(self) -> int:
        return len(self.slots)

    def _grow(self, need: int) -> None:
        cap = len(self.weights)
        if need <= cap:
            return
        new_cap = max(INITIAL_CAPACITY, cap * 2, need)
        w = torch.zeros(new_cap, self.spec.dim)
        w[:cap] = self.weights
        self.weights = w
        for k, t in self.state.items():
            s = torch.zeros(new_cap, *t.shape[1:])
            s[:cap] = t
            self.state[k] = s
        self.last = torch.cat([self.last, torch.zeros(new_cap - cap, dtype=torch.int64)])
        self.updates = torch.cat([self.updates, torch.zeros(new_cap - cap, dtype=torch.int64)])
        self.keys = np.concatenate([self.keys, np.zeros(new_cap - cap, dtype=np.uint64)])

    def find(self, keys: np.ndarray) -> list[int]:
        """The slot of each uint64 key, -1 where not held."""
        found = self.slots
        return [found.get(k, -1) for k in keys.tolist()]

    def create(self, keys: np.ndarray, values: torch.Tensor | None = None) -> list[int]:
        """New rows for distinct uint64 ``keys`` not held (their init, or ``values``): their slots."""
        start, n = self.size, len(keys)
        self._grow(start + n)
        self.weights[start:start + n] = init_rows(self.spec, keys) if values is None else values
        self.last[start:start + n] = self.steps
        self.updates[start:start + n] = 0
        self.keys[start:start + n] = keys
        for j, k in enumerate(keys.tolist()):
            self.slots[k] = start + j
        return list(range(start, start + n))

    def slots_of(self, keys: np.ndarray) -> torch.Tensor:
        """The row slot of each (distinct) uint64 key, creating the rows not yet held with their init."""
        out = self.find(keys)
        new = [i for i, s in enumerate(out) if s < 0]
        if new:
            for i, slot in zip(new, self.create(keys[new]), strict=True):
                out[i] = slot
        return torch.tensor(out, dtype=torch.int64)

    def read(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of distinct uint64 ``keys`` and their versions: created where not held, or (admission)
        their init, unstored (version 0)."""
        if self.spec.admit <= 1:
            slots = self.slots_of(keys)  # first: it may grow ``weights``
            return self.weights[slots], self.updates[slots]
        out = self.find(keys)
        held = [i for i, s in enumerate(out) if s >= 0]
        rows, versions = init_rows(self.spec, keys), torch.zeros(len(keys), dtype=torch.int64)
        if held:
            at, slots = torch.tensor(held), torch.tensor([out[i] for i in held])
            rows[at], versions[at] = self.weights[slots], self.updates[slots]
        return rows, versions

    def observe_staleness(self, keys: np.ndarray, base: np.ndarray) -> None:
        """Count, for each key pushed with a known base version (>= 0) whose row is held, the steps that
        updated its row since."""
        known = np.flatnonzero(base >= 0)
        if not len(known):
            return
        out = self.find(keys[known])
        held = [i for i, s in enumerate(out) if s >= 0]
        if held:
            now = self.updates[torch.tensor([out[i] for i in held])].numpy()
            self.staleness.update((now - base[known[held]]).clip(min=0).tolist())

    def admit(self, keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """The keys (and their gradient rows) a push may step: held, or admitted by this push."""
        if self.spec.admit <= 1:
            return keys, grads
        out = self.find(keys)
        keep = []
        for i, k in enumerate(keys.tolist()):
            if out[i] >= 0:
                keep.append(i)
                continue
            n = self.seen.get(k, 0) + 1
            if n >= self.spec.admit:
                self.seen.pop(k, None)
                self.counts["admitted"] += 1
                keep.append(i)
            else:
                self.seen[k] = n
                self.counts["dropped"] += 1
        return keys[keep], grads[keep]

    def expire(self) -> None:
        """Drop the rows not pushed for more than ``spec.expire`` steps (swap-remove: rows from the end fill
        the holes)."""
        if self.spec.expire <= 0 or not self.size:
            return
        n = self.size
        gone = torch.nonzero(self.last[:n] < self.steps - self.spec.expire).flatten()
        if not len(gone):
            return
        keep_n = n - len(gone)
        holes = gone[gone < keep_n]
        removed = set(gone.tolist())
        movers = torch.tensor([s for s in range(keep_n, n) if s not in removed], dtype=torch.int64)
        for k in self.keys[gone.numpy()].tolist():
            del self.slots[k]
        if len(holes):
            self.weights[holes] = self.weights[movers]
            for st in self.state.values():
                st[holes] = st[movers]
            self.last[holes] = self.last[movers]
            self.updates[holes] = self.updates[movers]
            self.keys[holes.numpy()] = self.keys[movers.numpy()]
            for h, k in zip(holes.tolist(), self.keys[holes.numpy()].tolist(), strict=True):
                self.slots[k] = h
        for st in self.state.values():  # a slot used again starts with zero state
            st[keep_n:n] = 0
        self.counts["expired"] += len(gone)

    def index_bytes(self) -> int:
        """Bytes held for the rows besides their weights and optimizer state: key, last step and version
        per row, and the key -> slot dict (its table, and a Python int key and slot per entry: 32 + 28 bytes,
        ``sys.getsizeof``)."""
        n = self.size
        return n * (self.keys.itemsize + self.last.element_size() + self.updates.element_size() + 60) + \
            sys.getsizeof(self.slots)

    def state_bytes(self) -> int:
        return sum(t[: self.size].numel() * t.element_size() for t in self.state.values())
