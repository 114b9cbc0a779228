"""One row table's rows on a shard: storage, first touch, admission, expiry, versions (docs/sparse.md).

A ``RowTable`` keeps its rows in one fp32 tensor ``[capacity, dim]`` that
grows by a quarter when full (at least to what a request needs), an index
from key to row slot (server/rows/index.py: open addressing over NumPy
arrays, each operation over a whole batch of keys), per slot its key, last
step and version, and its optimizer's state beside the rows
(server/optim/rowbase.py). Slots are dense: the rows held are slots
``0..size-1`` and slot i holds ``keys[i]``. Not thread-safe: ``RowTables``
(server/rows/tables.py) holds the lock over every call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from shardps.protos.rows import RowTableSpec, init_rows
from shardps.server.optim import RowOptimizer
from shardps.server.rows.index import DictIndex, KeyIndex
from shardps.server.sync import SyncPolicy

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
    index: KeyIndex | DictIndex = field(default_factory=KeyIndex)  # key -> row of ``weights``
    steps: int = 0  # optimizer steps applied (one per update the sync policy hands over, touched rows or not)
    # The sync policy (server/sync.py) of the mode and worker count the pushes name ("" and 0: none yet), and the
    # barrier rounds applied since the table was made (what a push's ``ready`` and a pull's ``min_round`` count).
    policy: SyncPolicy | None = None
    mode: tuple[str, int] = ("", 0)
    rounds: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # admission: pushes that carried each key not held
    counts: dict[str, int] = field(default_factory=dict)
    pushed: dict[int, int] = field(default_factory=dict)  # worker -> the last step of its taken in (its clock - 1)
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
        return self.index.live

    @property
    def slots(self) -> dict[int, int]:
        """{key: slot} of the rows held (a copy: for tests and reports)."""
        return dict(zip(self.keys[: self.size].tolist(), range(self.size), strict=True))

    def _grow(self, need: int) -> None:
        cap = len(self.weights)
        if need <= cap:
            return
        new_cap = max(INITIAL_CAPACITY, cap + cap // 4, need)
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

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each uint64 key (int64), -1 where not held."""
        return self.index.find(keys)

    def create(self, keys: np.ndarray, values: torch.Tensor | None = None) -> np.ndarray:
        """New rows for distinct uint64 ``keys`` not held (their init, or ``values``): their slots."""
        start, n = self.size, len(keys)
        self._grow(start + n)
        self.weights[start:start + n] = init_rows(self.spec, keys) if values is None else values
        self.last[start:start + n] = self.steps
        self.updates[start:start + n] = 0
        self.keys[start:start + n] = keys
        slots = np.arange(start, start + n, dtype=np.int64)
        self.index.insert(keys, slots)
        return slots

    def slots_of(self, keys: np.ndarray) -> torch.Tensor:
        """The row slot of each (distinct) uint64 key, creating the rows not yet held with their init."""
        out = self.find(keys)
        new = np.flatnonzero(out < 0)
        if len(new):
            out[new] = self.create(keys[new])
        return torch.from_numpy(out)

    def read(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of distinct uint64 ``keys`` and their versions (contiguous copies): created where not held,
        or (admission) their init, unstored (version 0)."""
        if self.spec.admit <= 1:
            found = self.slots_of(keys).numpy()  # first: it may grow ``weights``
            # NumPy's take: one thread, where torch's gather spreads over threads that, on a busy machine,
            # wait for each other
            return (torch.from_numpy(np.take(self.weights.numpy(), found, axis=0)),
                    torch.from_numpy(np.take(self.updates.numpy(), found)))
        out = self.find(keys)
        held = np.flatnonzero(out >= 0)
        rows, versions = init_rows(self.spec, keys), torch.zeros(len(keys), dtype=torch.int64)
        if len(held):
            at, slots = torch.from_numpy(held), torch.from_numpy(out[held])
            rows.index_copy_(0, at, self.weights.index_select(0, slots))
            versions.index_copy_(0, at, self.updates.index_select(0, slots))
        return rows, versions

    def observe_staleness(self, keys: np.ndarray, base: np.ndarray) -> None:
        """Count, for each key pushed with a known base version (>= 0) whose row is held, the steps that
        updated its row since."""
        known = np.flatnonzero(base >= 0)
        if not len(known):
            return
        out = self.find(keys[known])
        held = np.flatnonzero(out >= 0)
        if len(held):
            now = self.updates[torch.from_numpy(out[held])].numpy()
            steps, rows = np.unique((now - base[known[held]]).clip(min=0), return_counts=True)
            self.staleness.update(dict(zip(steps.tolist(), rows.tolist(), strict=True)))

    def admit(self, keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """The keys (and their gradient rows) a push may step: held, or admitted by this push."""
        if self.spec.admit <= 1:
            return keys, grads
        out = self.find(keys).tolist()
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
        self.index.remove(self.keys[gone.numpy()])
        if len(holes):
            self.weights[holes] = self.weights[movers]
            for st in self.state.values():
                st[holes] = st[movers]
            self.last[holes] = self.last[movers]
            self.updates[holes] = self.updates[movers]
            self.keys[holes.numpy()] = self.keys[movers.numpy()]
            self.index.move(self.keys[holes.numpy()], holes.numpy())
        for st in self.state.values():  # a slot used again starts with zero state
            st[keep_n:n] = 0
        self.counts["expired"] += len(gone)

    def index_bytes(self) -> int:
        """Bytes held for the rows besides their weights and optimizer state: key, last step and version
        per row, and the key -> slot index."""
        n = self.size
        return n * (self.keys.itemsize + self.last.element_size() + self.updates.element_size()) + \
            self.index.nbytes()

    def state_bytes(self) -> int:
        return sum(t[: self.size].numel() * t.element_size() for t in self.state.values())
