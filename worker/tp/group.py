"""A tensor-parallel group as the layers see it, and where each rank's slice of a tensor lies.

``TPGroup`` wraps one torch.distributed process group (``worker/groups.py``'s ``open_group``, named
``tp/...``; gloo on CPU, nccl on CUDA) with the few collectives tensor parallelism needs, called on the
group object itself: the group lives outside the default world, so ``torch.distributed.all_reduce(...,
group=)`` would not know it. Each collective waits at most the group's own deadline (set when it was
opened). ``TPGroup.single()`` is the group of one rank: every collective is the identity, so a model split
at TP = 1 runs with no process group at all. A ``torch.distributed`` ``ProcessGroup`` a user already has
(``init_process_group``, ``new_group``) is wrapped by ``TPGroup.from_process_group(pg)``; ``as_group`` is
the one place every public entry (``split``, the layers, ``TPOptimizer``) turns what it was given into a
``TPGroup``.

Slices are ``torch.chunk``'s: along ``dim``, rank r of p holds elements ``[r * c, min((r + 1) * c, n))``
with ``c = ceil(n / p)`` (the last rank's slice shorter, and empty where ``torch.chunk`` returns fewer than p
chunks). A ``Slice`` with ``parts > 1`` (the fused query, key and value projection of attention) cuts each of
``parts`` equal blocks along ``dim`` so and concatenates the rank's pieces, so that every rank holds whole
heads of each. A rank knows its slice without asking anyone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed

from shardps.protos.slices import chunk_range  # the one rule for a chunk's place, shared with the wire

dist: Any = torch.distributed


@dataclass(frozen=True)
class Slice:
    """How a parameter is split over a TP group: along ``dim``, each of ``parts`` equal blocks chunked."""

    dim: int
    parts: int = 1

    def ranges(self, n: int, p: int, rank: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges along ``dim`` of a tensor of size ``n`` there that rank holds."""
        if n % self.parts:
            raise ValueError(f"a dimension of {n} does not split into {self.parts} equal parts")
        block = n // self.parts
        out = []
        for k in range(self.parts):
            a, b = chunk_range(block, p, rank)
            out.append((k * block + a, k * block + b))
        return out

    def take(self, full: torch.Tensor, p: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the whole tensor ``full`` (a copy, contiguous)."""
        pieces = [full.narrow(self.dim, a, b - a) for a, b in self.ranges(full.shape[self.dim], p, rank)]
        return torch.cat(pieces, self.dim).contiguous()

    def put(self, full: torch.Tensor, piece: torch.Tensor, p: int, rank: int) -> None:
        """Write rank ``rank``'s slice ``piece`` into its place in ``full``."""
        at = 0
        for a, b in self.ranges(full.shape[self.dim], p, rank):
            full.narrow(self.dim, a, b - a).copy_(piece.narrow(self.dim, at, b - a))
            at += b - a

    def local_shape(self, shape: torch.Size | tuple[int, ...], p: int, rank: int) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = sum(b - a for a, b in self.ranges(shape[self.dim], p, rank))
        return tuple(out)


class TPGroup:
    """One tensor-parallel group: this member's ``rank`` of ``size`` and its collectives (blocking).

    Wrap a process group from ``shardps.worker.groups.open_group`` (``TPGroup(pg, rank, size)``); ``pg``
    None: not connected yet (``attach`` it before the first collective). Not thread-safe: one thread
    issues a group's collectives, in the same order on every rank (as in any torch.distributed program)."""

    def __init__(self, pg: Any, rank: int, size: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"a TP group's rank must be in [0, size), got rank {rank} of {size}")
        self.pg, self.rank, self.size = pg, rank, size
        self.collectives: dict[str, int] = {}  # collective kind -> calls, counted (benchmarks/tp.py)
        self.bytes: dict[str, int] = {}  # collective kind -> bytes of this rank's input, counted

    def __deepcopy__(self, memo: dict[int, Any]) -> TPGroup:
        return self  # a handle on the group's connections, shared by every copy of a module that uses it

    @classmethod
    def single(cls) -> TPGroup:
        return cls(None, 0, 1)

    @classmethod
    def from_process_group(cls, pg: Any) -> TPGroup:
        """The TP group of ``pg``, a ``torch.distributed`` ``ProcessGroup`` (``new_group(ranks)``, or the
        default group ``torch.distributed.group.WORLD``) or one backend of it (``ProcessGroupGloo``): its
        rank and size are the group's own, and the collectives run on ``pg`` itself."""
        if not _is_process_group(pg):
            raise TypeError(f"TPGroup.from_process_group: expected a torch.distributed ProcessGroup, "
                            f"got {type(pg).__name__}")
        return cls(pg, pg.rank(), pg.size())

    def attach(self, pg: Any) -> None:
        """Use process group ``pg`` from now on: a group made before its connections (a pipeline stage splits
        its model when it starts, and joins its TP group later, and again after a failed step)."""
        self.pg = pg

    def _pg(self) -> Any:
        if self.pg is None:
            raise RuntimeError(f"TP rank {self.rank} of {self.size}: not connected to its group yet")
        return self.pg

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.collectives[kind] = self.collectives.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + t.numel() * t.element_size()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``t`` reduced over the group in place (``op``: "sum" or "max"); returns ``t``."""
        if self.size == 1:
            return t
        self._count(f"all_reduce_{op}", t)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self._pg().allreduce([t], opts).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all ranks), in rank order."""
        if self.size == 1:
            return [t]
        self._count("all_gather", t)
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self._pg().allgather([outs], [t]).wait()
        return outs

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` replaced in place by rank ``src``'s (``t`` contiguous, same shape everywhere)."""
        if self.size == 1:
            return t
        self._count("broadcast", t)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg().broadcast([t], opts).wait()
        return t

    def all_gather_padded(self, t: torch.Tensor, dim: int, sizes: list[int]) -> list[torch.Tensor]:
        """Every rank's ``t``, whose size along ``dim`` is ``sizes[rank]`` (may differ): padded to the
        largest for the collective, each trimmed back."""
        if self.size == 1:
            return [t]
        return [g.narrow(dim, 0, n) for g, n in zip(self.all_gather(_pad(t, dim, max(sizes))), sizes)]

    def gather_padded(self, t: torch.Tensor, dim: int, sizes: list[int], dst: int) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (size ``sizes[rank]`` along ``dim``) on rank ``dst``, in rank order; None on
        the others."""
        if self.size == 1:
            return [t]
        most = max(sizes)
        padded = _pad(t.contiguous(), dim, most)
        self._count("gather", padded)
        outs = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == dst else []
        opts = dist.GatherOptions()
        opts.rootRank = dst
        self._pg().gather([outs] if outs else [], [padded], opts).wait()
        return [g.narrow(dim, 0, n) for g, n in zip(outs, sizes)] if self.rank == dst else None

    def scatter_padded(self, pieces: list[torch.Tensor] | None, out: torch.Tensor, dim: int, sizes: list[int],
                       src: int) -> torch.Tensor:
        """Rank ``src``'s ``pieces[rank]`` (size ``sizes[rank]`` along ``dim``) copied into each rank's
        ``out``; ``pieces`` is read on ``src`` only. Returns ``out``."""
        if self.size == 1:
            assert pieces is not None
            return out.copy_(pieces[0])
        most = max(sizes)
        shape = list(out.shape)
        shape[dim] = most
        recv = out.new_empty(shape)
        ins = [[_pad(q.contiguous(), dim, most) for q in pieces]] if self.rank == src and pieces is not None else []
        self._count("scatter", recv)
        opts = dist.ScatterOptions()
        opts.rootRank = src
        self._pg().scatter([recv], ins, opts).wait()
        return out.copy_(recv.narrow(dim, 0, sizes[self.rank]))


def _is_process_group(pg: Any) -> bool:
    """A ``ProcessGroup``, or one of its backends (``ProcessGroupGloo``, ``ProcessGroupNCCL``: the C++
    ``Backend`` class, not ``torch.distributed.Backend``, which names backends)."""
    if not dist.is_available():
        return False
    backend = getattr(torch._C._distributed_c10d, "Backend", None)
    return isinstance(pg, dist.ProcessGroup) or (backend is not None and isinstance(pg, backend))


#: What the public entries take for a group: a ``TPGroup``, a ``torch.distributed`` ``ProcessGroup``, or None.
GroupLike = Union["TPGroup", "torch.distributed.ProcessGroup", None]


def as_group(group: GroupLike, what: str = "group") -> TPGroup:
    """``group`` as a ``TPGroup``: a ``TPGroup`` as it is, a ``torch.distributed`` ``ProcessGroup`` wrapped
    (``TPGroup.from_process_group``), None the group of one rank. Anything else is a ``TypeError`` that
    names what was given and what is accepted."""
    if group is None:
        return TPGroup.single()
    if isinstance(group, TPGroup):
        return group
    if _is_process_group(group):
        return TPGroup.from_process_group(group)
    raise TypeError(f"{what}: expected a shardps.tp.TPGroup, a torch.distributed ProcessGroup or None, "
                    f"got {type(group).__name__}")


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def open_tp_group(store: Any, name: str, rank: int, size: int, *, host: str = "127.0.0.1", backend: str = "gloo",
                  timeout: float = 600.0) -> TPGroup:
    """Join TP group ``name`` (``"tp/..."``) of ``size`` ranks as ``rank`` through ``store`` (a rendezvous
    store, ``worker/groups.py``; or any ``torch.distributed.Store``, e.g. one ``HashStore`` shared by ranks
    that are threads of one process). Blocks until every rank has joined, at most ``timeout`` seconds."""
    from shardps.worker.groups import GroupSpec, open_group

    if size == 1:
        return TPGroup.single()
    return TPGroup(open_group(store, GroupSpec(name, rank, size, backend, timeout), host), rank, size)
