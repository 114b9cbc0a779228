"""Sync policies: when a shard applies the gradients it receives.

Small objects with no network and no lock of their own (the store calls them
under its lock), tested as tables in tests/server/test_sync.py.

- ``AsyncPolicy`` (``asp``): every gradient is applied on arrival.
- ``BarrierPolicy`` (``bsp`` and ``every:X``): the gradients of step t are
  held until every one of ``num_workers`` workers has sent one, then their
  mean is applied once. (For ``every:X`` the worker has already accumulated
  X local steps into the gradient it sends; ``step`` counts sync rounds.)

``offer`` returns an ``Offer``: whether the gradient was taken (or was a
duplicate of one already taken: a retried push is acknowledged, not applied
twice) and the updates that are now due, each with the contributions it
averages so the store can record their staleness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import FailedPrecondition

PartKey = tuple[str, int]  # (tensor name, start element of the part)
Grads = dict[PartKey, torch.Tensor]


@dataclass(frozen=True)
class Contribution:
    worker_id: int
    step: int
    base_version: int
    found_inf: bool = False  # an inf/nan somewhere in this worker's gradient of this step


@dataclass
class Update:
    """Gradients due for one optimizer step, and where they came from."""

    grads: Grads
    contributions: list[Contribution]


@dataclass
class Offer:
    duplicate: bool = False
    updates: list[Update] = field(default_factory=list)


class SyncPolicy:
    spec: SyncSpec

    def offer(self, c: Contribution, grads: Grads) -> Offer:
        raise NotImplementedError

    def waiting_on(self) -> str:
        """Who a waiter is waiting for, for deadline messages."""
        return ""


class AsyncPolicy(SyncPolicy):
    def __init__(self, spec: SyncSpec | None = None) -> None:
        self.spec = spec or SyncSpec("asp")
        self._last_step: dict[int, int] = {}

    def offer(self, c: Contribution, grads: Grads) -> Offer:
        if c.step <= self._last_step.get(c.worker_id, -1):
            return Offer(duplicate=True)
        self._last_step[c.worker_id] = c.step
        return Offer(updates=[Update(grads, [c])])


class BarrierPolicy(SyncPolicy):
    """Mean of every worker's gradient of a step, applied once when all are in."""

    def __init__(self, num_workers: int, spec: SyncSpec | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec = spec or SyncSpec("bsp")
        self.num_workers = num_workers
        self.next_step = 0
        self._sum: Grads = {}
        self._counts: dict[PartKey, int] = {}
        self._pending: list[Contribution] = []

    @property
    def pending_workers(self) -> list[int]:
        return sorted(c.worker_id for c in self._pending)

    def waiting_on(self) -> str:
        missing = sorted(set(range(self.num_workers)) - set(self.pending_workers))
        return f"step {self.next_step} has gradients from workers {self.pending_workers}, missing {missing}"

    def offer(self, c: Contribution, grads: Grads) -> Offer:
        if c.step < self.next_step:
            return Offer(duplicate=True)  # that step is applied already
        if c.step == self.next_step and any(p.worker_id == c.worker_id for p in self._pending):
            return Offer(duplicate=True)  # a retry of a gradient already held
        if c.step > self.next_step:
            raise FailedPrecondition(
                f"worker {c.worker_id} pushed step {c.step}, but the barrier is at step "
                f"{self.next_step} ({self.waiting_on()})"
            )
        for key, g in grads.items():
            acc = self._sum.get(key)
            if acc is None:
                self._sum[key] = g  # the store hands over a fresh buffer it no longer uses
            else:
                acc.add_(g)
            self._counts[key] = self._counts.get(key, 0) + 1
        self._pending.append(c)
        if len(self._pending) < self.num_workers:
            return Offer()
        for key, n in self._counts.items():
            if n > 1:
                self._sum[key].div_(n)
        update = Update(self._sum, self._pending)
        self._sum, self._counts, self._pending = {}, {}, []
        self.next_step += 1
        return Offer(updates=[update])


def make_policy(spec: SyncSpec, num_workers: int) -> SyncPolicy:
    if spec.barrier:
        return BarrierPolicy(num_workers, spec)
    return AsyncPolicy(spec)


def staleness(version_at_apply: int, contributions: Iterable[Contribution]) -> list[int]:
    """Shard version at apply minus the version each gradient was computed from."""
    return [max(0, version_at_apply - c.base_version) for c in contributions]
