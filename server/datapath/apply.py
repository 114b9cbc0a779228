"""The apply step of one shard: an update the sync policy handed over becomes an optimizer step.

``Applier`` is the store's part that steps the tensors of its ``TensorTable``.
It holds what the step needs besides the tensors: the staleness remedy
(lr-scale, dc-asgd and the weights each worker pulled), the loss scaler and
the scaling the job was configured with, the optimizers with a scaled lr,
the ``StagingPool`` of spare fp32 gradient buffers (one per part, its own
small lock: Push assembly asks for buffers without the store's lock), the
step counters and hooks, and the way to the peers of split tensors
(``peers``, ``exchange``: server/replication/peers.py).

Its ``step`` runs under the store's lock (``cond``), which it is given: a
split tensor's step exchanges statistics with its peers and releases the
lock around each fetch, with ``applying`` set; every other reader and
writer of the tensors first waits for it to end (``settle``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from shardps.protos.optim import OptimizerSpec
from shardps.server.errors import Unavailable
from shardps.server.optim import ServerOptimizer, make_optimizer
from shardps.server.optim.base import PartInfo, Reduce, State
from shardps.server.remedies import Remedy, RemedyKind, compensate, lr_factor
from shardps.server.replication.peers import ExchangeTable, Key, PeerReducer, Peers
from shardps.server.scaling import LossScaler, ScalingConfig, scaling_config
from shardps.server.sync import Chunked, Grads, Update, staleness
from shardps.server.table import PartKey, PartState, TensorEntry, TensorTable

Item = tuple[torch.Tensor, torch.Tensor, State, PartInfo]  # what ServerOptimizer.step_many takes


class StagingPool:
    """One spare fp32 staging buffer per part: a gradient that nothing references any more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: dict[PartKey, torch.Tensor] = {}

    def take(self, key: PartKey, numel: int) -> torch.Tensor:
        """An fp32 buffer of ``numel`` for a pushed part: a recycled one when there is one."""
        with self._lock:
            buf = self._pool.pop(key, None)
        if buf is None or buf.numel() != numel:
            buf = torch.empty(numel, dtype=torch.float32)
        return buf

    def recycle(self, key: PartKey, buf: torch.Tensor) -> None:
        with self._lock:
            self._pool.setdefault(key, buf.view(-1))


@dataclass(frozen=True)
class Applied:
    skipped: bool  # an inf/nan in some contribution: no step taken
    seconds: float
    staleness: list[int]


class Applier:
    """The optimizer step of one shard's tensors, its counters and its remedies; see the module docstring."""

    def __init__(self, shard_index: int, cond: threading.Condition, table: TensorTable, *,
                 peers: Peers | None = None, exchange_timeout_s: float = 60.0) -> None:
        self.shard_index = shard_index
        self._cond = cond
        self.table = table
        self.remedy = Remedy()
        self.scaler: LossScaler | None = None
        self.scaling_configured: ScalingConfig | None = None  # as configured (the scale moves)
        self.stale_weights: dict[int, dict[PartKey, torch.Tensor]] = {}  # dc-asgd: what each worker pulled
        self.pool = StagingPool()
        self._scaled_impls: dict[OptimizerSpec, ServerOptimizer] = {}
        self.peers = peers  # the other shards (split tensors); given at start-up
        self.exchange = ExchangeTable()  # partials published for the peers (served by the Exchange RPC)
        self.exchange_timeout_s = exchange_timeout_s
        self.applying = False  # a split tensor's step waits for its peers with the lock released
        # Counters, read by stats() (and by metrics).
        self.applied_updates_total = 0
        self.gradients_applied_total = 0
        self.skipped_steps_total = 0
        self.apply_seconds_total = 0.0
        self.staleness_counts: Counter[int] = Counter()
        self.on_apply: list[Callable[[float], None]] = []  # called with each step's seconds, under the lock

    def settle(self) -> None:
        """Under the lock: wait until no split tensor's step is in flight (its thread released the lock)."""
        if self.applying and not self._cond.wait_for(lambda: not self.applying,
                                                     timeout=2 * self.exchange_timeout_s + 5):
            raise Unavailable(f"shard {self.shard_index}: a step waiting for its peers did not end")

    def step(self, update: Update, version: int) -> bool:
        """Under the lock, no Pull reading the weights: one optimizer step at ``version`` (or a skipped one, an
        inf/nan in some contribution: False). The caller advances the version either way.

        A split tensor's step exchanges statistics with its peers: the lock
        is released around each fetch, with ``applying`` set so that no
        other thread reads or changes the tensors meanwhile.
        """
        split = any(self.table[name].spec.split for name, _ in update.grads)
        self.applying = split
        try:
            done = self.apply(self.table, update, version, self._reducer)
        finally:
            if split:
                self.applying = False
                self._cond.notify_all()
        self.skipped_steps_total += 1 if done.skipped else 0
        self.apply_seconds_total += done.seconds
        for hook in self.on_apply:
            hook(done.seconds)
        self.staleness_counts.update(done.staleness)
        self.gradients_applied_total += 0 if done.skipped else len(update.contributions)
        self.applied_updates_total += 0 if done.skipped else 1
        return not done.skipped

    def _reducer(self, entry: TensorEntry) -> Reduce:
        return PeerReducer(self.exchange, self._fetch_unlocked, entry.spec.name, entry.rounds, self.shard_index,
                           entry.spec.holders, self.exchange_timeout_s)

    def _fetch_unlocked(self, shard: int, key: Key, from_shard: int, timeout: float) -> torch.Tensor:
        """A peer's partial, fetched with the lock released (the caller holds it, with ``applying`` set)."""
        peers = self.peers
        if peers is None:
            raise Unavailable(f"shard {self.shard_index} has no connection to its peers: it is not served")
        assert self.applying
        self._cond.release()
        try:
            return peers.fetch(shard, key, from_shard, timeout)
        finally:
            self._cond.acquire()

    def add_peers(self, entries: Iterable[TensorEntry]) -> None:
        """Tell the peers the addresses of the split tensors among ``entries`` (when served)."""
        if self.peers is not None:
            for e in entries:
                if e.spec.split:
                    self.peers.set_addresses(e.spec.peers)

    @property
    def scaling(self) -> ScalingConfig | None:
        return scaling_config(self.scaler)

    @property
    def loss_scale(self) -> float:
        """The scale workers should use next; 0.0 when loss scaling is off."""
        return self.scaler.scale if self.scaler is not None else 0.0

    def impl(self, entry: TensorEntry, factor: float) -> ServerOptimizer:
        """The tensor's optimizer, with its lr scaled by ``factor`` (lr-scale remedy)."""
        if factor == 1.0:
            return entry.optimizer
        spec = dataclasses.replace(entry.spec.optimizer, lr=entry.spec.optimizer.lr * factor)  # type: ignore[attr-defined, call-arg]
        impl = self._scaled_impls.get(spec)
        if impl is None:
            impl = self._scaled_impls[spec] = make_optimizer(spec)
        return impl

    def remember_pulled(self, tensors: TensorTable, worker_id: int, names: list[str]) -> None:
        """dc-asgd: keep the weights ``worker_id`` pulled, to compensate its next gradient."""
        mine = self.stale_weights.setdefault(worker_id, {})
        for n in names:
            for start, part in tensors[n].parts.items():
                kept = mine.get((n, start))
                if kept is None:
                    mine[(n, start)] = part.weight.clone()
                else:
                    kept.copy_(part.weight)

    def apply(self, tensors: TensorTable, update: Update, version: int,
              reduce_for: Callable[[TensorEntry], Reduce]) -> Applied:
        """One optimizer step on every part of ``update`` (or a skipped one), at shard ``version``.

        A gradient still in its received chunks (``Chunked``) is stepped from them, each chunk a slice
        of its part, when nothing writes to it and the optimizer takes slices (an elementwise
        kernel: the same result bit for bit); otherwise it is copied into a staging buffer first.
        """
        t0 = time.perf_counter()
        skip = any(c.found_inf for c in update.contributions)
        staged: Grads = {}  # buffers taken from the pool here, recycled below
        if not skip:
            groups: dict[OptimizerSpec, tuple[ServerOptimizer, list[Item]]] = {}
            stale = staleness(version, update.contributions)
            factor = lr_factor(sum(stale) / len(stale)) if self.remedy.kind is RemedyKind.LR_SCALE else 1.0
            backup = (self.stale_weights.get(update.contributions[0].worker_id)
                      if self.remedy.kind is RemedyKind.DC_ASGD and len(update.contributions) == 1 else None)

            def group(entry: TensorEntry) -> tuple[ServerOptimizer, list[Item]]:
                """The step_many group of ``entry``'s optimizer spec: its implementation and items."""
                found = groups.get(entry.spec.optimizer)
                if found is None:
                    found = groups[entry.spec.optimizer] = (self.impl(entry, factor), [])
                return found

            for (name, start), g in update.grads.items():
                entry = tensors[name]
                part = entry.parts[start]
                pulled = backup.get((name, start)) if backup is not None else None  # dc-asgd compensates
                grouped = not entry.spec.split and (entry.spec.optimizer.elementwise or part.info.whole)
                if isinstance(g, Chunked):
                    if grouped and pulled is None and entry.spec.optimizer.elementwise and g.sliceable:
                        impl, items = group(entry)
                        if impl.takes_slices():
                            items.extend(slices(part, g, impl))
                            continue
                    g = staged[(name, start)] = g.copy_to(self.pool.take((name, start), g.numel()))
                grad = g.view(part.weight.shape)
                if pulled is not None:
                    compensate(grad, part.weight, pulled, self.remedy.dc_lambda)
                if entry.spec.split:
                    entry.optimizer.step(part.weight, grad, part.state, part.info, reduce_for(entry))
                elif grouped:
                    group(entry)[1].append((part.weight, grad, part.state, part.info))
                else:
                    self.impl(entry, factor).step(part.weight, grad, part.state, part.info)
            for impl, items in groups.values():
                impl.step_many(items)
            for name in {name for name, _ in update.grads}:
                tensors[name].rounds += 1
        for key, g in update.grads.items():
            if isinstance(g, torch.Tensor):
                self.pool.recycle(key, g)
        for key, g in staged.items():
            self.pool.recycle(key, g)
        if self.scaler is not None:
            self.scaler.update(skip)
        return Applied(skip, time.perf_counter() - t0, staleness(version, update.contributions))


def slices(part: PartState, g: Chunked, impl: ServerOptimizer) -> list[Item]:
    """One step item per chunk of ``g``: the chunk, and the weight and state slices it covers."""
    chunks = [v for _, v in g.pieces]  # in order, from element 0 of the part, each after the last
    sizes = [v.numel() for v in chunks]
    weights = torch.split(part.weight.view(-1), sizes)
    return [(w, v, st, part.info) for w, v, st in zip(weights, chunks, impl.split_state(part.state, sizes))]

