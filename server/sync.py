"""Sync policies: when a shard applies the gradients it receives.

Small objects with no network and no lock of their own (the store calls them
under its lock), tested as tables in tests/server/test_sync.py. The store
drops retried pushes before they get here (a worker's steps are consecutive:
a step it already sent is a duplicate), so a policy sees each gradient once.

- ``AsyncPolicy`` (``asp`` and ``ssp:S``): every gradient is applied on
  arrival. For ``ssp:S`` the store also makes a worker wait, before its next
  step, until the slowest worker is at most S clocks behind (see
  ``Job.wait_clock``); that is a wait, not an application rule.
- ``BarrierPolicy`` (``bsp`` and ``every:X``): gradients are held until every
  one of ``num_workers`` workers has sent one for the current round, then
  their mean is applied once. Rounds count arrivals, not step numbers, so a
  job can switch into a barrier mode whatever its workers' clocks are. (For
  ``every:X`` the worker has already accumulated X local steps into the
  gradient it sends.)

``offer`` returns the updates now due, each with the contributions it
averages so the store can record their staleness; ``flush`` hands over what
is held (when the job switches sync mode), so no gradient is ever dropped.
A gradient computed under a mode the job has since left (``late``: its step
straddled the switch) is applied at once under asp and ssp, and summed into
the current round under a barrier, beside the workers' own: a barrier's
version then still moves by whole rounds only, which is what a worker's
wait for its ``ready_version`` relies on. Nobody waits for a late gradient
(``holds`` is False for it): its worker's next pull takes the weights as
they are, as the mode it ran under would have.

Row tables use the same policies, one per table (server/rows/tables.py):
their gradient is a ``RowGrad`` (keys and rows, summed by concatenation).

The store asks a policy everything it needs through ``SyncPolicy`` (never
its class): the live workers changed (``live_changed``, ``track_live``),
whether nothing is held (``quiescent``, when a checkpoint may be taken),
and what it holds, to snapshot and restore (``held_state``,
``restore_held``). A new sync mode is a ``SyncSpec`` and a policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import FailedPrecondition

PartKey = tuple[str, int]  # (tensor name, start element of the part)
Grads = dict[PartKey, torch.Tensor]

#: Pieces of a ``Chunked`` gradient may be stepped as slices of their part only when every piece but the
#: last is a multiple of this many elements: a fused kernel then splits the elements into vector lanes and
#: a scalar tail exactly as it does for the whole part, so the step is bit for bit the same.
SLICE_ALIGN = 64


class Chunked:
    """A part's fp32 gradient as it was received: views of the Push messages' payloads, never copied.

    ``pieces`` are (offset in the part, 1-D fp32 view), in order, covering ``[0, numel)`` once (the
    ChunkAssembler checked that). The memory is the received messages', read-only: it is read (stepped
    from, copied or added elsewhere), never written. An asp step reads it where it lies (see
    ``Applier.apply``); anything that modifies a gradient gets a copy first (``materialize``).
    """

    __slots__ = ("_numel", "pieces")

    def __init__(self, numel: int, pieces: list[tuple[int, torch.Tensor]]) -> None:
        self._numel = numel
        self.pieces = pieces

    def numel(self) -> int:
        return self._numel

    @property
    def sliceable(self) -> bool:
        """Every piece but the last is whole lanes of ``SLICE_ALIGN`` elements (see there)."""
        return all(v.numel() % SLICE_ALIGN == 0 for _, v in self.pieces[:-1])

    def copy_to(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``numel`` fp32 elements) holding the gradient."""
        flat = out.view(-1)
        for a, v in self.pieces:
            flat[a : a + v.numel()].copy_(v)
        return out

    def add_to(self, acc: torch.Tensor) -> None:
        """``acc += gradient``, elementwise, read straight from the pieces."""
        flat = acc.view(-1)
        for a, v in self.pieces:
            flat[a : a + v.numel()].add_(v)


class RowGrad:
    """A row table's gradient as a barrier holds it (server/rows/tables.py): each push's distinct keys and
    their gradient rows, summed by concatenation (a key several pushes carry is summed when the round is
    applied), scaled in place. The barrier treats it as it treats a part's fp32 tensor (``add_``, ``div_``)."""

    __slots__ = ("keys", "grads")

    def __init__(self, keys: list[np.ndarray], grads: list[torch.Tensor]) -> None:
        self.keys, self.grads = keys, grads

    def add_(self, other: RowGrad) -> RowGrad:
        self.keys += other.keys
        self.grads += other.grads
        return self

    def div_(self, n: int) -> RowGrad:
        self.grads = [g / n for g in self.grads]
        return self

    def joined(self) -> tuple[np.ndarray, torch.Tensor]:
        """(every key, every gradient row) in the order the pushes came."""
        dim = self.grads[0].shape[1] if self.grads else 0
        keys = np.concatenate(self.keys) if self.keys else np.zeros(0, dtype=np.uint64)
        return keys, torch.cat(self.grads) if self.grads else torch.zeros(0, dim)


Grad = torch.Tensor | Chunked
Received = Mapping[PartKey, Grad]  # gradients as the store takes them: fp32 tensors, or still in their chunks


def materialize(grads: Received, alloc: Callable[[PartKey, int], torch.Tensor]) -> Grads:
    """``grads`` as fp32 tensors the store may keep and modify: ``Chunked`` ones copied into ``alloc``'s buffers."""
    return {key: g if isinstance(g, torch.Tensor) else g.copy_to(alloc(key, g.numel())) for key, g in grads.items()}


@dataclass(frozen=True)
class Contribution:
    worker_id: int
    step: int
    base_version: int
    found_inf: bool = False  # an inf/nan somewhere in this worker's gradient of this step
    # Computed under a sync mode the job has left (a step that straddled a live switch): a barrier sums it
    # into its round as one gradient more, not as the worker's own (that one is still to come).
    late: bool = False


@dataclass
class Update:
    """Gradients due for one optimizer step, and where they came from."""

    grads: Received
    contributions: list[Contribution]


@dataclass
class HeldState:
    """What a round holds: per-part sums and counts, the contributions, the rounds completed."""

    sums: Grads
    counts: dict[PartKey, int]
    contributions: list[Contribution]
    rounds: int


class SyncPolicy:
    spec: SyncSpec
    #: ``offer`` hands every gradient on as it came, held by nobody: the store may then give it gradients
    #: still in their received chunks (``Chunked``); otherwise it gives fp32 tensors only.
    passes_through = False

    def offer(self, c: Contribution, grads: Received, weights: Mapping[PartKey, int] | None = None) -> list[Update]:
        """The updates now due (a policy that does not pass gradients through is given fp32 tensors only).
        ``weights``: how many gradients a part counts for (1 for those not named; a sliced Push's, which only
        a barrier takes: server/datapath/slicepush.py)."""
        raise NotImplementedError

    def check_offer(self, c: Contribution) -> None:
        """Raise what ``offer`` would refuse ``c`` with, changing nothing: the store asks before it records the
        push for its backup, which must never be sent a push the primary refused."""

    def flush(self) -> list[Update]:
        """Whatever is held, as updates (the job is leaving this mode)."""
        return []

    def holds(self, worker_id: int) -> bool:
        """True when a gradient of ``worker_id`` waits for the current round."""
        return False

    def waiting_on(self) -> str:
        """Who a waiter is waiting for, for deadline messages."""
        return ""

    def live_changed(self, live: set[int]) -> list[Update]:
        """The live workers changed (an eviction, a leave, a rejoin): the updates now due."""
        return []

    def track_live(self, live: set[int]) -> None:
        """The live workers, when this policy takes over (a switch, a restore); nothing becomes due."""

    def quiescent(self) -> bool:
        """True when no gradient is held (a checkpoint now holds no half-done round)."""
        return True

    def held_state(self) -> HeldState | None:
        """What is held, for a snapshot (None: this mode holds nothing between pushes)."""
        return None

    def restore_held(self, held: HeldState) -> None:
        """Hold again what a snapshot's ``held_state`` was (ignored by modes that hold nothing)."""


class AsyncPolicy(SyncPolicy):
    passes_through = True

    def __init__(self, spec: SyncSpec | None = None) -> None:
        self.spec = spec or SyncSpec("asp")

    def offer(self, c: Contribution, grads: Received, weights: Mapping[PartKey, int] | None = None) -> list[Update]:
        return [Update(grads, [c])]


class BarrierPolicy(SyncPolicy):
    """Mean of every worker's next gradient, applied once when all are in."""

    def __init__(self, num_workers: int, spec: SyncSpec | None = None,
                 release: Callable[[PartKey, torch.Tensor], None] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec = spec or SyncSpec("bsp")
        self._release = release  # takes back a gradient buffer once it is summed in
        self.num_workers = num_workers
        self.expected: set[int] = set(range(num_workers))  # live workers: a round needs each of them
        self.rounds = 0  # completed rounds
        self._sum: Grads = {}
        self._counts: dict[PartKey, int] = {}
        self._pending: list[Contribution] = []

    @property
    def pending_workers(self) -> list[int]:
        """The workers whose own gradient of this round is in (``late`` ones do not count)."""
        return sorted(c.worker_id for c in self._pending if not c.late)

    def holds(self, worker_id: int) -> bool:
        """The worker's own gradient waits for this round (a ``late`` one is not waited for: its mode is over)."""
        return any(p.worker_id == worker_id and not p.late for p in self._pending)

    def held(self) -> tuple[Grads, dict[PartKey, int], list[Contribution]]:
        """What the current round holds (sums, counts, contributions), for checkpoints."""
        return self._sum, self._counts, self._pending

    def restore(self, sums: Grads, counts: dict[PartKey, int], pending: list[Contribution], rounds: int) -> None:
        self._sum, self._counts, self._pending, self.rounds = dict(sums), dict(counts), list(pending), rounds

    def held_state(self) -> HeldState:
        return HeldState(self._sum, self._counts, self._pending, self.rounds)

    def restore_held(self, held: HeldState) -> None:
        self.restore(held.sums, held.counts, held.contributions, held.rounds)

    def quiescent(self) -> bool:
        return not self._pending

    def live_changed(self, live: set[int]) -> list[Update]:
        return self.set_expected(live)

    def track_live(self, live: set[int]) -> None:
        self.expected = set(live)

    def waiting_on(self) -> str:
        missing = sorted(self.expected - set(self.pending_workers))
        return f"round {self.rounds} has gradients from workers {self.pending_workers}, missing {missing}"

    def set_expected(self, live: set[int]) -> list[Update]:
        """The live workers changed (an eviction, a rejoin): the round may be complete now."""
        self.expected = set(live)
        if self._pending and self.expected <= set(self.pending_workers):
            return self.flush()
        return []

    def check_offer(self, c: Contribution) -> None:
        held = next((p for p in self._pending if p.worker_id == c.worker_id and not p.late), None)
        if held is not None and not c.late:  # (a late one comes before the worker's own, never after)
            raise FailedPrecondition(
                f"worker {c.worker_id} pushed step {c.step} while its step {held.step} still waits for "
                f"the barrier ({self.waiting_on()}): pull the next version before pushing again"
            )

    def offer(self, c: Contribution, grads: Received, weights: Mapping[PartKey, int] | None = None) -> list[Update]:
        self.check_offer(c)
        for key, g in grads.items():
            assert isinstance(g, (torch.Tensor, RowGrad)), "a barrier is given fp32 tensors (passes_through is False)"
            acc = self._sum.get(key)
            if acc is None:
                self._sum[key] = g  # the store hands over a fresh buffer it no longer uses
            else:
                acc.add_(g)
                if self._release is not None:
                    self._release(key, g)
            self._counts[key] = self._counts.get(key, 0) + (weights.get(key, 1) if weights else 1)
        self._pending.append(c)
        if not self.expected <= {p.worker_id for p in self._pending if not p.late}:
            return []
        return self.flush()

    def flush(self) -> list[Update]:
        if not self._pending:
            return []
        for key, n in self._counts.items():
            if n > 1:
                self._sum[key].div_(n)
        update = Update(self._sum, self._pending)
        self._sum, self._counts, self._pending = {}, {}, []
        self.rounds += 1
        return [update]


def make_policy(spec: SyncSpec, num_workers: int,
                release: Callable[[PartKey, torch.Tensor], None] | None = None) -> SyncPolicy:
    if spec.barrier:
        return BarrierPolicy(num_workers, spec, release)
    return AsyncPolicy(spec)


def staleness(version_at_apply: int, contributions: Iterable[Contribution]) -> list[int]:
    """Shard version at apply minus the version each gradient was computed from."""
    return [max(0, version_at_apply - c.base_version) for c in contributions]
