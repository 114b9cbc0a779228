"""A row table's key -> slot index: open addressing over NumPy arrays, every operation over a batch of keys.

A Python dict costs a lookup in the interpreter per key and ~100 bytes per
entry; this index costs a few array operations per batch and 16 bytes per
entry of its capacity (a uint64 key and an int64 slot), its load kept
between 1/5 and 3/5 (27 to 80 bytes a row; rebuilt to at most 2/5 when
it passes 3/5).

Linear probing from ``mix64(key) & (capacity - 1)`` (protos/rows.py: every
bit of the key spreads). A slot of -1 is empty, -2 a key removed (a
tombstone: probes go on past it; inserts reuse it). ``find`` probes all
keys of a batch at once, one step of every probe per round, so it takes as
many rounds as the longest probe. ``insert`` places a batch the same way,
the first of several keys that reach one empty entry in a round taking it.
Not thread-safe: the table's lock (server/rows/table.py) is held over every call.
"""

from __future__ import annotations

import sys

import numpy as np

from shardps.protos.rows import mix64

EMPTY, REMOVED = -1, -2
MIN_CAPACITY = 1024


class KeyIndex:
    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        cap = MIN_CAPACITY
        while cap < capacity:
            cap *= 2
        self.keys = np.zeros(cap, dtype=np.uint64)
        self.slots = np.full(cap, EMPTY, dtype=np.int64)
        self.live = 0  # keys held
        self.used = 0  # entries not empty: keys held and tombstones

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.slots.nbytes)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        home: np.ndarray = (mix64(keys) & np.uint64(self.capacity - 1)).astype(np.int64)
        return home

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """The entry of each uint64 key, -1 where not held."""
        out = np.full(len(keys), -1, dtype=np.int64)
        pending = np.arange(len(keys))
        pos = self._home(keys)
        mask = self.capacity - 1
        while len(pending):
            s = self.slots[pos]
            hit = (s >= 0) & (self.keys[pos] == keys[pending])
            out[pending[hit]] = pos[hit]
            go_on = ~hit & (s != EMPTY)
            pending, pos = pending[go_on], (pos[go_on] + 1) & mask
        return out

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each uint64 key, -1 where not held."""
        at = self.positions(keys)
        return np.where(at >= 0, self.slots[np.maximum(at, 0)], -1)

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Add distinct uint64 ``keys`` not held, at ``slots``."""
        if 5 * (self.used + len(keys)) > 3 * self.capacity:
            self._rebuild(self.live + len(keys))
        pending = np.arange(len(keys))
        pos = self._home(keys)
        mask = self.capacity - 1
        while len(pending):
            s = self.slots[pos]
            free = np.flatnonzero(s < 0)
            taken = np.zeros(len(pending), dtype=bool)
            if len(free):
                _, first = np.unique(pos[free], return_index=True)  # one key per free entry this round
                win = free[first]
                at = pos[win]
                self.used += int(np.count_nonzero(self.slots[at] == EMPTY))
                self.keys[at] = keys[pending[win]]
                self.slots[at] = slots[pending[win]]
                taken[win] = True
            pending, pos = pending[~taken], (pos[~taken] + 1) & mask
        self.live += len(keys)

    def remove(self, keys: np.ndarray) -> None:
        """Drop held uint64 ``keys`` (each held once)."""
        at = self.positions(keys)
        assert (at >= 0).all(), "removing keys not held"
        self.slots[at] = REMOVED
        self.live -= len(keys)

    def move(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Held uint64 ``keys`` now live at ``slots``."""
        self.slots[self.positions(keys)] = slots

    def _rebuild(self, need: int) -> None:
        """A table of capacity for ``need`` keys at a load of at most 2/5, the live entries moved in."""
        live = self.slots >= 0
        keys, slots = self.keys[live], self.slots[live]
        cap = MIN_CAPACITY
        while 2 * cap < 5 * need:
            cap *= 2
        self.keys = np.zeros(cap, dtype=np.uint64)
        self.slots = np.full(cap, EMPTY, dtype=np.int64)
        self.live = self.used = 0
        self.insert(keys, slots)


class DictIndex:
    """The same operations over a Python dict (one interpreter lookup per key): what the tables used before
    ``KeyIndex``, kept to measure against it (benchmarks/rows.py --index)."""

    ENTRY_BYTES = 60  # a key (a Python int of up to 64 bits: 32 bytes) and its slot (28) per entry

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    @property
    def live(self) -> int:
        return len(self.slots)

    def nbytes(self) -> int:
        return sys.getsizeof(self.slots) + self.ENTRY_BYTES * len(self.slots)

    def find(self, keys: np.ndarray) -> np.ndarray:
        get = self.slots.get
        return np.array([get(k, -1) for k in keys.tolist()], dtype=np.int64)

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self.slots.update(zip(keys.tolist(), slots.tolist(), strict=True))

    def remove(self, keys: np.ndarray) -> None:
        for k in keys.tolist():
            del self.slots[k]

    def move(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self.insert(keys, slots)
