"""The shard map: which server owns which range of which tensor.

A pure, deterministic function of (tensors, number of servers, part size):
every worker computes the same map from the same inputs, so no coordinator
is needed. Tensors are cut into parts (row blocks for tensors of rank >= 2,
flat ranges for vectors), and parts are assigned to servers largest first,
each to the least loaded server (longest-processing-time greedy), which keeps
the most loaded server within a part's size of the mean.

Tensors whose optimizer combines statistics over the whole tensor
(``splittable=False``: Adafactor, SM3) stay in one part up to
``max_whole_bytes``. A larger one is cut into at most one row block per
server, block i on server i (``ShardMap.holders``), so each holder steps
exactly one part and the holders reduce their statistics among themselves.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

DEFAULT_PARTS_PER_SERVER = 16
MIN_PART_BYTES = 256 << 10
MAX_PART_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorInfo:
    """What the shard map needs to know of a tensor."""

    name: str
    shape: tuple[int, ...]
    itemsize: int = 4
    splittable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def row_numel(self) -> int:
        """Elements per row block unit: trailing dims for rank >= 2, else 1."""
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else 1


@dataclass(frozen=True, order=True)
class Part:
    """Elements ``[start, stop)`` of the flat tensor ``name``, owned by ``server``."""

    name: str
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def part_shape(shape: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    """The shape of a part: a row block for rank >= 2 (when aligned), else flat."""
    shape = tuple(shape)
    if len(shape) >= 2:
        row = math.prod(shape[1:])
        if row and start % row == 0 and stop % row == 0:
            return ((stop - start) // row,) + shape[1:]
    if len(shape) == 0 and (start, stop) == (0, 1):
        return ()
    return (stop - start,)


K = TypeVar("K")


def _index(parts: Sequence[Part], key: Callable[[Part], K]) -> dict[K, tuple[Part, ...]]:
    out: dict[K, list[Part]] = {}
    for p in parts:
        out.setdefault(key(p), []).append(p)
    return {k: tuple(v) for k, v in out.items()}


@dataclass(frozen=True)
class ShardMap:
    num_servers: int
    parts: tuple[Part, ...]
    tensors: tuple[TensorInfo, ...] = field(default=())

    def parts_for(self, server: int) -> list[Part]:
        """The parts ``server`` holds, in shard-map order."""
        return list(self._by_server.get(server, ()))

    def parts_of(self, name: str) -> list[Part]:
        """The parts of tensor ``name``, in shard-map order."""
        return list(self._by_name.get(name, ()))

    # Indexes made on first use (a push asks each shard's parts every step: no scan of the whole map). The map
    # is frozen, so they stay true; cached_property writes the instance's __dict__ directly.
    @functools.cached_property
    def _by_server(self) -> dict[int, tuple[Part, ...]]:
        return _index(self.parts, lambda p: p.server)

    @functools.cached_property
    def _by_name(self) -> dict[str, tuple[Part, ...]]:
        return _index(self.parts, lambda p: p.name)

    def holders(self, name: str) -> list[int]:
        """For a split unsplittable tensor: its servers in row order; else []."""
        info = next((t for t in self.tensors if t.name == name), None)
        parts = self.parts_of(name)
        if info is None or info.splittable or len(parts) < 2:
            return []
        return [p.server for p in parts]

    def server_bytes(self) -> list[int]:
        size = {t.name: t.itemsize for t in self.tensors}
        loads = [0] * self.num_servers
        for p in self.parts:
            loads[p.server] += p.numel * size.get(p.name, 4)
        return loads

    def imbalance(self) -> float:
        """Most loaded server's bytes over the mean, minus one (0.0 is perfect)."""
        loads = self.server_bytes()
        mean = sum(loads) / len(loads)
        return max(loads) / mean - 1.0 if mean else 0.0


def _cut(t: TensorInfo, part_bytes: int, max_whole_bytes: int) -> list[tuple[int, int]]:
    n = t.numel
    if n == 0:
        return []
    if not t.splittable:
        return [(0, n)]
    unit = t.row_numel
    units_total = n // unit
    units_per_part = max(1, part_bytes // max(1, unit * t.itemsize))
    nparts = math.ceil(units_total / units_per_part)
    # Even split into nparts pieces (differ by at most one unit).
    bounds = [(units_total * k) // nparts * unit for k in range(nparts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def build_shard_map(
    tensors: Sequence[TensorInfo],
    num_servers: int,
    *,
    part_bytes: int | None = None,
    max_whole_bytes: int = 256 << 20,
) -> ShardMap:
    """Cut tensors into parts and assign them to ``num_servers`` servers.

    ``part_bytes`` defaults to total bytes / (servers * 16), clamped to
    [256 KiB, 64 MiB]: each part is a frame, a message and a step of its own
    on its shard, and below 256 KiB that cost outweighs the finer balance
    (docs/performance.md, "Parts of a shard's size"). The result depends only on the arguments (tensors are
    taken in name order), never on the order they were given in.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup}")
    ordered = sorted(tensors, key=lambda t: t.name)
    total = sum(t.nbytes for t in ordered)
    if part_bytes is None:
        part_bytes = total // (num_servers * DEFAULT_PARTS_PER_SERVER)
        part_bytes = min(MAX_PART_BYTES, max(MIN_PART_BYTES, part_bytes))
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")

    pieces: list[tuple[int, str, int, int]] = []  # (bytes, name, start, stop)
    parts: list[Part] = []
    loads = [0] * num_servers
    for t in ordered:
        if not t.splittable and t.nbytes > max_whole_bytes and num_servers > 1:
            # One row block per server, block i on server i.
            rows = t.numel // t.row_numel
            k = min(num_servers, rows)
            bounds = [(rows * i) // k * t.row_numel for i in range(k + 1)]
            for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                parts.append(Part(t.name, a, b, i))
                loads[i] += (b - a) * t.itemsize
            continue
        for a, b in _cut(t, part_bytes, max_whole_bytes):
            pieces.append(((b - a) * t.itemsize, t.name, a, b))
    # Largest first; ties broken by name and start so the order is total.
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))
    heap = [(loads[s], s) for s in range(num_servers)]
    heapq.heapify(heap)
    for nbytes, name, a, b in pieces:
        load, server = heapq.heappop(heap)
        parts.append(Part(name, a, b, server))
        heapq.heappush(heap, (load + nbytes, server))
    parts.sort(key=lambda p: (p.name, p.start))
    return ShardMap(num_servers=num_servers, parts=tuple(parts), tensors=tuple(ordered))
