"""ShardStore: one shard: its lock, version, epoch, the data path (submit, waits, reads) and sync switches.

Pure Python/torch, no gRPC: other servers are reached through the ``Peers``
and ``ReplicaLink`` interfaces it is given (server/peers.py). The parts it
is made of, each in its own module: the tensor table (table.py), leases and
membership (membership.py), the apply step (apply.py), the pull framing
cache (pullcache.py), the snapshot codec (snapshot.py, used by checkpoint.py
and replication), the replica side (replica.py); the sync policy (sync.py).

Versions: a shard starts at version 0 and adds one per optimizer step it
applies (under BSP, one per step of the job; under ASP, one per gradient).

LOCK ORDER (a lock may be taken while holding only those listed before it)::

    _ckpt_lock    one checkpoint write or rollback at a time (holds it over disk I/O)
    _replay_lock  backup: one replicated op replayed, or a promotion, at a time
    _cond         the store's lock and condition: tensors, version, epoch, policy,
                  membership, counters. Every wait on it has a timeout.
    leaf locks    taken under _cond, taking nothing else: StagingPool's, the
                  ExchangeTable's, the Replicator's (record), PeerChannels'

No network call is made while holding _cond or _replay_lock: a split
tensor's step releases _cond around ``Peers.fetch`` (``_applying`` keeps
every other reader and writer of the tensors out meanwhile, see
``_settle``); a promotion asks the primary's health with no lock held, then
checks its role again. (_ckpt_lock is held over the checkpoint's disk
writes, never over a call to another server.)
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardps.protos import codec, framing
from shardps.protos.stats import ShardStats, TensorStats
from shardps.protos.syncspec import SyncSpec
from shardps.server import checkpoint, snapshot
from shardps.server.apply import Applier, scaling_config
from shardps.server.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from shardps.server.membership import DEFAULT_LEASE_S, Clock, Membership, Reaper
from shardps.server.optim.base import Reduce
from shardps.server.peers import ExchangeTable, Key, PeerReducer, Peers, ReplicaLink, ReplicaSink
from shardps.server.pullcache import Item, PullCache, frame
from shardps.server.remedies import Remedy
from shardps.server.replica import (
    DEFAULT_REPLICA_TIMEOUT_S,
    OpKind,
    ReplicaMixin,
    ReplicaState,
    Role,
)
from shardps.server.scaling import LossScaler, unscale_and_check
from shardps.server.snapshot import COUNTERS, ShardState, pack, part_keys
from shardps.server.sync import Contribution, Grads, PartKey, SyncPolicy, Update, make_policy
from shardps.server.table import TensorEntry, TensorSpec, TensorTable

__all__ = ["DEFAULT_LEASE_S", "PushResult", "ShardStore", "TensorSpec"]

log = logging.getLogger("shardps.server")


@dataclass
class PushResult:
    version: int  # the shard's version now
    applied: bool
    duplicate: bool
    loss_scale: float = 0.0
    ready_version: int = 0  # the first version that includes this gradient


class ShardStore(ReplicaMixin):
    """The state of one shard. See the module docstring for the contract."""

    def __init__(self, shard_index: int = 0, num_shards: int = 1, *, sync: str | None = None,
                 num_workers: int | None = None, exchange_timeout_s: float = 60.0,
                 lease_s: float = DEFAULT_LEASE_S, role: str = "primary", clock: Clock = time.monotonic,
                 peers: Peers | None = None, replica_link: ReplicaLink | None = None) -> None:
        if role not in (Role.PRIMARY, Role.BACKUP):
            raise ValueError(f"role must be 'primary' or 'backup', got {role!r}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._applying = False  # a split tensor's step waits for its peers with _cond released
        self._tensors = TensorTable(shard_index)
        self.membership = Membership(shard_index, lease_s, clock)
        self._reaper = Reaper(self.evict_expired, lambda: max(0.05, self.lease_s / 4), f"shard{shard_index}-leases")
        self._sync: SyncSpec | None = None
        self._policy: SyncPolicy | None = None
        self.applier = Applier()
        self._scaling_config: tuple[float, float, float, int] | None = None  # as configured (the scale moves)
        self.pullcache = PullCache()
        self._ckpt_dir: str | None = None
        self._ckpt_every, self._ckpt_seconds, self._ckpt_keep = 0, 0.0, 3
        self._ckpt_last = time.monotonic()
        self._ckpt_version = -1
        self._ckpt_lock = threading.Lock()
        self.checkpoints_total = 0
        self.closing = False
        self.waiting = 0  # Pulls parked in a barrier/SSP/version wait right now
        self.epoch = 0  # rollbacks of the job so far
        self.recovering = False  # restarted from a checkpoint: data RPCs wait for the job's rollback
        self.exchange = ExchangeTable()  # partials published for the peers (served by the Exchange RPC)
        self.peers = peers  # the other shards (split tensors); given by create_server
        self.replica_link = replica_link  # opens the backup's sink; given by create_server
        self.exchange_timeout_s = exchange_timeout_s
        self.version = 0
        # Counters, read by stats() (and by metrics).
        self.pushes_total = 0
        self.duplicate_pushes_total = 0
        self.applied_updates_total = 0
        self.gradients_applied_total = 0
        self.push_bytes_total = 0
        self.pull_bytes_total = 0
        self.apply_seconds_total = 0.0
        self.skipped_steps_total = 0
        self.sync_switches_total = 0
        self.pulls_total = 0
        self.on_apply: list[Callable[[float], None]] = []  # called with each step's seconds, under the lock
        self.staleness_counts: Counter[int] = Counter()
        self.worker_clocks: dict[int, int] = {}
        # Replication (replica.py). A primary with a backup records every change of its state into
        # ``replicator``; a backup (role BACKUP) replays them and serves after a Promote.
        self.role = Role(role)
        self.address = ""  # this shard's own address, once served
        self.replicator: ReplicaSink | None = None
        self.replica_timeout_s = DEFAULT_REPLICA_TIMEOUT_S
        self.moved_to = ""  # deposed: the backup that took over
        self.primary_address = ""  # backup role: the primary it copies
        self.replica_seq = 0  # backup role: the last op applied
        self.replica_synced = False
        self.replica_incarnation = ""  # backup role: the run of the primary whose copy it holds
        self.promotions_total = 0
        self._replay_lock = threading.Lock()
        if sync is not None or num_workers is not None:
            if sync is None or num_workers is None:
                raise ValueError("give both sync and num_workers, or neither")
            self.configure(num_workers, sync)

    def _settle(self) -> None:
        """Under _cond: wait until no split tensor's step is in flight (its thread released _cond)."""
        if self._applying and not self._cond.wait_for(lambda: not self._applying,
                                                      timeout=2 * self.exchange_timeout_s + 5):
            raise Unavailable(f"shard {self.shard_index}: a step waiting for its peers did not end")

    # -- job and membership -------------------------------------------------

    def configure(self, num_workers: int, sync: str, loss_scaling: LossScaler | None = None,
                  remedy: str | None = None) -> SyncSpec:
        """Set the job's worker count, sync mode and loss scaling once; return the mode in force.

        Later calls must agree on the worker count and loss scaling. The sync
        mode is the job's (it may have been switched since): a worker asking
        for another one is told the mode in force and follows it.
        """
        try:
            spec = SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        try:
            rem = Remedy.parse(remedy)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        scaling = scaling_config(loss_scaling)
        with self._cond:
            ap = self.applier
            if self._sync is None:
                self._sync, self.membership.num_workers = spec, num_workers
                self._policy = make_policy(spec, num_workers, ap.pool.recycle)
                ap.scaler, self._scaling_config = loss_scaling, scaling
                ap.remedy = rem
                self._record(OpKind.CONFIGURE, {"num_workers": num_workers, "sync": str(spec), "remedy": str(rem),
                                                "scaling": list(scaling) if scaling else None})
            elif self.num_workers != num_workers:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs a job of num_workers={self.num_workers}; "
                    f"a worker registered with num_workers={num_workers}"
                )
            elif ap.remedy != rem:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs staleness remedy {ap.remedy}; a worker asked for {rem}"
                )
            elif self._scaling_config != scaling:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs loss scaling {self._scaling_config or 'off'} "
                    f"(init, growth, backoff, interval); a worker asked for {scaling or 'off'}"
                )
            return self._sync

    @property
    def loss_scale(self) -> float:
        """The scale workers should use next; 0.0 when loss scaling is off."""
        return self.applier.loss_scale

    @property
    def remedy(self) -> Remedy:
        return self.applier.remedy

    @property
    def sync(self) -> SyncSpec | None:
        return self._sync

    @property
    def num_workers(self) -> int | None:
        return self.membership.num_workers

    @property
    def lease_s(self) -> float:
        return self.membership.lease_s

    @lease_s.setter
    def lease_s(self, value: float) -> None:
        self.membership.lease_s = value

    @property
    def evictions_total(self) -> int:
        return self.membership.evictions_total

    @property
    def leaves_total(self) -> int:
        return self.membership.leaves_total

    @leaves_total.setter
    def leaves_total(self, value: int) -> None:  # restored with the counters
        self.membership.leaves_total = value

    @property
    def framed_hits_total(self) -> int:
        return self.pullcache.hits_total

    def register_worker(self, worker_id: int) -> None:
        """A worker joins (or rejoins after an eviction): it holds a lease from now on."""
        with self._cond:
            self.check_worker_id(worker_id)
            m = self.membership
            if worker_id not in m.workers or worker_id in m.evicted:  # a change the backup replays
                self._record(OpKind.REGISTER_WORKER, {"worker": worker_id})
            joined = m.register(worker_id)
            if joined.rejoined:
                log.log(logging.WARNING if joined.was_evicted else logging.INFO,
                        "shard %d: worker %d rejoined at clock %d", self.shard_index, worker_id,
                        self.worker_clocks.get(worker_id, -1) + 1)
            if joined.live_changed:
                self._live_changed()

    def leave(self, worker_id: int) -> bool:
        """A worker is done and says so: from now on barriers and SSP clocks go on without it.

        Unlike an eviction this is the normal end of a worker (no warning,
        no ``evictions_total``). Idempotent; registering again rejoins.
        Returns whether the worker was registered.
        """
        with self._cond:
            self.check_worker_id(worker_id)
            if worker_id not in self.membership.workers:
                return False
            self._record(OpKind.LEAVE, {"worker": worker_id})
            self.membership.leave(worker_id)
            log.info("shard %d: worker %d left at clock %d; steps now complete with workers %s", self.shard_index,
                     worker_id, self.worker_clocks.get(worker_id, -1) + 1, sorted(self.live_workers()))
            self._live_changed()
            return True

    def touch(self, worker_id: int) -> None:
        """The worker is alive (any Push, Pull or Heartbeat renews its lease)."""
        with self._cond:
            self.membership.touch(worker_id)

    def live_workers(self) -> set[int]:
        """Workers that count for barriers and SSP clocks: all of the job's but the evicted and those that left."""
        return self.membership.live()

    def _live_changed(self) -> None:
        if self._policy is not None:
            for update in self._policy.live_changed(self.live_workers()):
                self._apply(update)
        self._cond.notify_all()

    def _renew_leases(self) -> None:
        self.membership.renew_all()

    def evict_expired(self, now: float | None = None) -> list[int]:
        """Evict registered workers whose lease expired; barriers complete with the live ones."""
        now = self.clock() if now is None else now
        with self._cond:
            if self.role != Role.PRIMARY:  # a backup replays its primary's evictions; a starting one waits
                return []
            expired = self.membership.expired(now)
            self._evict(expired, now)
            return expired

    def _evict(self, expired: list[int], now: float | None = None) -> None:
        if expired:
            self._record(OpKind.EVICT, {"workers": expired})
            self.membership.evict(expired, now)
            self._live_changed()

    def start_reaper(self) -> None:
        """Check leases in the background, a few times per lease."""
        if self.lease_s > 0:
            self._reaper.start()

    def stop_reaper(self) -> None:
        """Stop the lease checks and wait for the thread to end."""
        self._reaper.stop()

    def check_worker_id(self, worker_id: int) -> None:
        self.membership.check_worker_id(worker_id)

    def _check_registered(self, worker_id: int) -> None:
        self.membership.check_registered(worker_id)

    # -- tensors ------------------------------------------------------------

    def spec(self, name: str) -> TensorSpec:
        """The registered spec of ``name``; NotFound if there is none."""
        return self._tensors.spec(name)

    def names(self) -> list[str]:
        with self._cond:
            return sorted(self._tensors)

    def _split_names(self) -> list[str]:
        return self._tensors.split_names()

    def register_tensors(self, specs: Sequence[TensorSpec],
                         values: dict[PartKey, torch.Tensor] | None) -> list[str]:
        """Create the tensors not yet held, from ``values`` (fp32, one per part).

        Tensors already held must have an equal spec (FAILED_PRECONDITION
        otherwise) and keep their weights. With ``values=None`` nothing is
        created: tensors not yet held are an error (see wait_for_tensors).
        All-or-nothing. Returns the names created.
        """
        TensorTable.validate(specs, self.shard_index)
        with self._cond:
            self._settle()
            entries = self._tensors.new_entries(specs, values, replicated=self.replicator is not None,
                                                sync=self._sync, remedy=self.remedy)
            self._tensors.add(entries)
            for e in entries:
                if e.spec.split and self.peers is not None:
                    self.peers.set_addresses(e.spec.peers)
            if entries:
                self._record(OpKind.REGISTER_TENSORS, {"specs": [snapshot.spec_to_json(e.spec) for e in entries]},
                             {f"{a}/{e.spec.name}": p.weight.clone() for e in entries for a, p in e.parts.items()})
                self._cond.notify_all()
            return [e.spec.name for e in entries]

    def wait_for_tensors(self, names: Iterable[str], timeout: float) -> None:
        """Block until every name is registered; DeadlineExceeded names the missing."""
        wanted = list(names)
        with self._cond:
            ok = self._cond.wait_for(lambda: all(n in self._tensors for n in wanted), timeout)
            if not ok:
                missing = [n for n in wanted if n not in self._tensors]
                raise DeadlineExceeded(
                    f"shard {self.shard_index}: waited {timeout:.1f}s for worker 0 to register "
                    f"{len(missing)} tensors (first: {missing[:3]})"
                )

    # -- the data path ------------------------------------------------------

    def staging(self, key: PartKey, numel: int) -> torch.Tensor:
        """An fp32 buffer of ``numel`` for a pushed part: a recycled one when there is one."""
        return self.applier.pool.take(key, numel)

    def submit(self, worker_id: int, step: int, base_version: int, grads: Grads,
               nbytes: int = 0, *, found_inf: bool = False, loss_scale: float = 0.0,
               epoch: int | None = None, checked: bool = False) -> PushResult:
        """Hand one worker's gradient of ``step`` to the sync policy; apply what is due.

        ``grads`` maps (name, part start) to fp32 tensors the store may keep
        and modify (``checked``: the caller has already set ``found_inf`` for
        any inf/nan in them). A gradient computed with a loss scale is unscaled here
        (x 1/loss_scale in fp32). An optimizer step any of whose gradients
        had an inf/nan (flagged by the worker or found here) is skipped on
        every shard alike, and the loss scale backs off. Raises (changing
        nothing) for an unregistered worker, a step or base version that
        cannot be, or a step the policy refuses.
        """
        if not (loss_scale == 0.0 or (math.isfinite(loss_scale) and loss_scale > 0)):
            raise InvalidArgument(f"loss_scale must be a positive finite number or 0, got {loss_scale}")
        with self._cond:
            self.check_epoch(epoch)
            self._check_registered(worker_id)
            self.membership.last_seen[worker_id] = self.clock()
            if step < 0:
                raise InvalidArgument(f"step must be >= 0, got {step}")
            if not 0 <= base_version <= self.version:
                raise InvalidArgument(
                    f"base_version {base_version} is outside [0, {self.version}] "
                    f"(shard {self.shard_index} is at version {self.version})"
                )
            for (name, start), g in grads.items():
                self._tensors.part(name, start, g.numel())
        # Unscale and check outside the lock: the buffers are this request's own. ``checked``:
        # the caller already looked at every value (the Push assembly does, chunk by chunk).
        if loss_scale or not checked:
            found_inf = unscale_and_check(list(grads.values()), loss_scale) or found_inf
        # The backup replays the gradient as taken in here (unscaled); packed (copied) before the sync
        # policy may sum other workers' gradients into these buffers.
        packed = pack(part_keys(grads)) if self.replicator else None
        with self._cond:
            self._settle()
            self.check_epoch(epoch)
            policy = self._policy
            assert policy is not None  # registered workers imply a job
            last = self.worker_clocks.get(worker_id, -1)
            if step <= last:  # a retry of a push already taken in
                self.pushes_total += 1
                self.duplicate_pushes_total += 1
                ready = self.version + (1 if policy.holds(worker_id) else 0)
                return PushResult(self.version, applied=False, duplicate=True, loss_scale=self.loss_scale,
                                  ready_version=ready)
            if step != last + 1:
                raise FailedPrecondition(
                    f"worker {worker_id} pushed step {step}, but its last step on shard {self.shard_index} "
                    f"was {last}: steps go up by one"
                )
            if self.replicator is not None:
                if packed is None:  # a backup was attached in between
                    packed = pack(part_keys(grads))
                self.replicator.record(OpKind.SUBMIT, {"worker": worker_id, "step": step,
                                                       "base_version": base_version, "found_inf": found_inf,
                                                       "nbytes": nbytes}, packed=packed)
            updates = policy.offer(Contribution(worker_id, step, base_version, found_inf), grads)
            self.pushes_total += 1
            self.push_bytes_total += nbytes
            self.worker_clocks[worker_id] = step
            applied = False
            for update in updates:
                applied |= self._apply(update)
            policy = self._policy
            assert policy is not None
            ready = self.version + (1 if policy.holds(worker_id) else 0)
            self._cond.notify_all()  # versions and clocks moved
            result = PushResult(self.version, applied=applied, duplicate=False, loss_scale=self.loss_scale,
                                ready_version=ready)
            due = applied and self._checkpoint_due() and policy.quiescent()
        if due:
            self.checkpoint_now()
        return result

    def _apply(self, update: Update) -> bool:
        """One optimizer step (or a skipped one); the version advances either way. Under the lock.

        A split tensor's step exchanges statistics with its peers: ``_cond``
        is released around each fetch, with ``_applying`` set so that no
        other thread reads or changes the tensors meanwhile.
        """
        self._settle()
        self.pullcache.clear()
        split = any(self._tensors[name].spec.split for name, _ in update.grads)
        self._applying = split
        try:
            done = self.applier.apply(self._tensors, update, self.version, self._reducer)
        finally:
            if split:
                self._applying = False
                self._cond.notify_all()
        self.apply_seconds_total += done.seconds
        for hook in self.on_apply:
            hook(done.seconds)
        self.staleness_counts.update(done.staleness)
        self.gradients_applied_total += 0 if done.skipped else len(update.contributions)
        self.applied_updates_total += 0 if done.skipped else 1
        self.version += 1
        return not done.skipped

    def _reducer(self, entry: TensorEntry) -> Reduce:
        return PeerReducer(self.exchange, self._fetch_unlocked, entry.spec.name, entry.rounds, self.shard_index,
                           entry.spec.holders, self.exchange_timeout_s)

    def _fetch_unlocked(self, shard: int, key: Key, from_shard: int, timeout: float) -> torch.Tensor:
        """A peer's partial, fetched with _cond released (the caller holds it, with _applying set)."""
        peers = self.peers
        if peers is None:
            raise Unavailable(f"shard {self.shard_index} has no connection to its peers: it is not served")
        assert self._applying
        self._cond.release()
        try:
            return peers.fetch(shard, key, from_shard, timeout)
        finally:
            self._cond.acquire()

    def _check_halted(self) -> None:
        if self.closing:
            raise Unavailable(f"shard {self.shard_index} is shutting down")
        if self.moved_to:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {self.moved_to}")

    def check_epoch(self, epoch: int | None) -> None:
        """ABORTED when the job was rolled back since the worker's epoch, or this shard awaits it."""
        if self.recovering:
            raise Aborted(f"shard {self.shard_index} restarted from its checkpoint at version {self.version}: "
                          f"the job must roll back to a checkpoint all shards hold "
                          f"(versions here: {self.checkpoint_versions()})")
        if epoch is not None and epoch != self.epoch:
            raise Aborted(f"the job was rolled back (shard {self.shard_index} is in epoch {self.epoch}, "
                          f"the request in {epoch}): resync")

    def _wait(self, ready: Callable[[], bool], timeout: float) -> tuple[bool, int]:
        """Park until ``ready`` or a halt, rollback or takeover; (ready, epoch at the start)."""
        start_epoch = self.epoch
        self.waiting += 1
        try:
            ok = self._cond.wait_for(lambda: ready() or self.closing or self.epoch != start_epoch
                                     or self.moved_to != "", timeout)
        finally:
            self.waiting -= 1
            self._cond.notify_all()
        if ok:
            self._check_halted()
        return ok, start_epoch

    def wait_version(self, min_version: int, timeout: float, epoch: int | None = None) -> int:
        """Block until the shard reaches ``min_version``; return the version then."""
        with self._cond:
            ok, start_epoch = self._wait(lambda: self.version >= min_version, timeout)
            if ok:
                self.check_epoch(start_epoch if epoch is None else epoch)
                return self.version
            waiting = self._policy.waiting_on() if self._policy else "no job configured"
            raise DeadlineExceeded(
                f"shard {self.shard_index} is at version {self.version}, waited {timeout:.1f}s "
                f"for version {min_version}: {waiting}"
            )

    def clocks(self) -> dict[int, int]:
        """Each worker's clock: the number of steps it has pushed (0 before its first)."""
        with self._cond:
            return self._clocks()

    def _clocks(self) -> dict[int, int]:
        """Clocks of the live workers (evicted ones do not hold SSP back)."""
        return {w: self.worker_clocks.get(w, -1) + 1 for w in sorted(self.live_workers())}

    def wait_clock(self, min_clock: int, timeout: float) -> int:
        """Block until every worker's clock is >= ``min_clock`` (SSP); return the slowest clock."""
        with self._cond:
            def slowest() -> int:
                c = self._clocks()
                return min(c.values()) if c else 0

            ok, start_epoch = self._wait(lambda: slowest() >= min_clock, timeout)
            if ok:
                self.check_epoch(start_epoch)
                return slowest()
            behind = {w: c for w, c in self._clocks().items() if c < min_clock}
            raise DeadlineExceeded(
                f"shard {self.shard_index}: waited {timeout:.1f}s for every worker to reach clock "
                f"{min_clock} ({self._sync}); behind: {behind}"
            )

    def set_sync(self, sync: str) -> SyncSpec:
        """Switch the running job's sync mode. Held gradients are applied first, none is lost."""
        try:
            spec = SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        with self._cond:
            self._settle()
            if self._sync is None or self.num_workers is None or self._policy is None:
                raise FailedPrecondition(f"shard {self.shard_index} has no job yet: nothing to switch")
            if spec == self._sync:
                return spec
            if not spec.barrier and self._tensors.has_split():
                raise FailedPrecondition(
                    f"shard {self.shard_index} holds tensors split with cross-shard statistics, which "
                    f"need bsp or every:X; cannot switch to {spec}"
                )
            self._record(OpKind.SET_SYNC, {"sync": str(spec)})
            for update in self._policy.flush():
                self._apply(update)
            old = self._sync
            self._sync, self._policy = spec, make_policy(spec, self.num_workers, self.applier.pool.recycle)
            self._policy.track_live(self.live_workers())
            self.sync_switches_total += 1
            self._cond.notify_all()
        log.info("shard %d: sync %s -> %s", self.shard_index, old, spec)
        return spec

    def read(self, names: Sequence[str], wire_dtype: int | None,
             chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, *, messages: bool = False,
             slowest_clock: int = 0, worker_id: int | None = None) -> tuple[int, list[Item]]:
        """A consistent snapshot: (version, [(name, offset, wire dtype, payload)]).

        ``wire_dtype=None`` sends each tensor in its registered dtype. The
        payloads are taken under the lock, so they all belong to ``version``.

        ``messages=True``: each payload is instead a whole serialized
        ``PullResponse`` (version, the loss scale and sync mode of that
        moment, ``slowest_clock`` as given, and the chunk, its tensor's shape
        on the tensor's first chunk), framed straight from the weights: one
        copy of the data, made once per version for all the Pulls that ask
        the same (every worker's, under bsp; see pullcache.py).
        """
        with self._cond:
            self._settle()
            entries = [self._tensors.get(n) for n in names]
            for n, e in zip(names, entries):
                if e is None:
                    self.spec(n)  # raises NotFound
            if self.remedy.kind == "dc-asgd" and worker_id is not None and worker_id in self.membership.workers:
                self._remember_pulled(worker_id, list(names))
            header = None
            if messages:
                key = (tuple(names), wire_dtype, chunk_bytes, slowest_clock, self.loss_scale, str(self._sync or ""))
                hit = self.pullcache.get(key)
                if hit is not None:
                    self.pull_bytes_total += hit[1]
                    self.pulls_total += 1
                    return self.version, hit[0]
                header = framing.pull_header(self.version, self.loss_scale, str(self._sync or ""), slowest_clock)
            out, nbytes = frame(entries, wire_dtype, chunk_bytes, header)  # type: ignore[arg-type]
            self.pull_bytes_total += nbytes
            self.pulls_total += 1
            if messages:
                self.pullcache.put(key, out, nbytes)
            return self.version, out

    def _remember_pulled(self, worker_id: int, names: list[str]) -> None:
        """dc-asgd: keep the weights ``worker_id`` pulled, to compensate its next gradient."""
        self._record(OpKind.PULLED, {"worker": worker_id, "names": names})
        self.applier.remember_pulled(self._tensors, worker_id, names)

    def export_state(self, names: Sequence[str]) -> tuple[int, list[tuple[str, int, int, str, torch.Tensor]]]:
        """A consistent copy of weights and optimizer state: (version, [(name, start, stop, key, tensor)]).

        ``key`` is "weight" for the fp32 master weights, else the optimizer
        state's own key (e.g. "exp_avg", "step").
        """
        with self._cond:
            self._settle()
            for n in names:
                self.spec(n)
            out = []
            for n in names:
                for start, part in sorted(self._tensors[n].parts.items()):
                    out.append((n, start, part.stop, "weight", part.weight.clone()))
                    for key in sorted(part.state):
                        out.append((n, start, part.stop, key, part.state[key].clone()))
            return self.version, out

    def weights(self, name: str) -> dict[int, torch.Tensor]:
        """Copies of the fp32 master weights of ``name``, by part start (for tests and tools)."""
        with self._cond:
            self._settle()
            self.spec(name)
            return {s: p.weight.clone() for s, p in self._tensors[name].parts.items()}

    # -- checkpoints ----------------------------------------------------------

    def enable_checkpoints(self, directory: str, *, every_steps: int = 0, every_seconds: float = 0.0,
                           keep: int = 3) -> None:
        """Checkpoint into ``directory`` every ``every_steps`` versions and/or after ``every_seconds``.

        Under bsp and every:X all shards apply the same rounds, so step-based
        checkpoints land on the same versions on every shard.
        """
        if every_steps < 0 or every_seconds < 0:
            raise ValueError("checkpoint intervals must be >= 0")
        self._ckpt_dir, self._ckpt_every, self._ckpt_seconds, self._ckpt_keep = (
            directory, every_steps, every_seconds, keep)
        self._ckpt_last = time.monotonic()

    def _checkpoint_due(self) -> bool:
        if not self._ckpt_dir or self._ckpt_version == self.version or self.role != Role.PRIMARY:
            return False
        if self._ckpt_every and self.version % self._ckpt_every == 0:
            return True
        return bool(self._ckpt_seconds) and time.monotonic() - self._ckpt_last >= self._ckpt_seconds

    def checkpoint_now(self) -> str:
        """Write a checkpoint of the current state; return the path of its metadata."""
        if not self._ckpt_dir:
            raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory (--checkpoint-dir)")
        with self._ckpt_lock:
            version, meta, tensors = self.snapshot()
            path = checkpoint.write(self._ckpt_dir, self.shard_index, version, meta, tensors, keep=self._ckpt_keep)
            self._ckpt_version, self._ckpt_last = version, time.monotonic()
            self.checkpoints_total += 1
        log.info("shard %d: checkpoint at version %d: %s", self.shard_index, version, path)
        return str(path)

    def checkpoint_versions(self) -> list[int]:
        return checkpoint.list_versions(self._ckpt_dir, self.shard_index) if self._ckpt_dir else []

    def rollback(self, version: int, epoch: int) -> tuple[int, int]:
        """Restore the checkpoint at ``version`` and enter ``epoch`` (no-op if already there).

        Waits in progress end with ABORTED, so their workers resync too.
        """
        with self._ckpt_lock:
            if epoch <= self.epoch and not self.recovering:
                return self.version, self.epoch
            if not self._ckpt_dir:
                raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory")
            try:
                c = checkpoint.load(self._ckpt_dir, self.shard_index, version)
            except ValueError as e:
                raise FailedPrecondition(f"shard {self.shard_index} cannot roll back to version {version}: {e} "
                                         f"(checkpoints: {self.checkpoint_versions()})") from None
            self.restore(c.version, c.meta, c.tensors())
            with self._cond:
                self.epoch = max(epoch, self.epoch + 1)
                self.recovering = False
                self._ckpt_version = c.version
                self._record_snapshot()
                self._cond.notify_all()
        log.warning("shard %d: rolled back to version %d, epoch %d", self.shard_index, version, self.epoch)
        return self.version, self.epoch

    def restore_latest(self, at_most: int | None = None) -> int | None:
        """Restore the newest complete checkpoint (at or below ``at_most``); its version, or None."""
        if not self._ckpt_dir:
            return None
        c = checkpoint.latest(self._ckpt_dir, self.shard_index, at_most)
        if c is None:
            return None
        self.restore(c.version, c.meta, c.tensors())
        self._ckpt_version = c.version
        return c.version

    def close(self) -> None:
        """Shutting down: waits in progress end with UNAVAILABLE, new requests are refused."""
        self._reaper.signal_stop()
        with self._cond:
            self.closing = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.waiting == 0, timeout=5.0)  # parked waits have left

    # -- the whole state (snapshot.py) ----------------------------------------

    def snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        """Everything needed to restore this shard: (version, JSON-able meta, tensors).

        Weights, optimizer state, the gradients a barrier round holds, the
        version, each worker's last step (the exactly-once bookkeeping), the
        loss scaler and the counters. Tensors are copies taken under the lock.
        """
        with self._cond:
            return self._snapshot()

    def _snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        self._settle()
        m = self.membership
        return snapshot.encode(ShardState(
            version=self.version, num_shards=self.num_shards, sync=self._sync, num_workers=m.num_workers,
            workers=sorted(m.workers), evicted=sorted(m.evicted), left=sorted(m.left),
            worker_clocks=self.worker_clocks, scaler=self.applier.scaler, remedy=self.remedy, epoch=self.epoch,
            entries=self._tensors.entries, held=self._policy.held_state() if self._policy else None,
            counters={k: getattr(self, k) for k in COUNTERS}, staleness_counts=self.staleness_counts,
            stale_weights=self.applier.stale_weights))

    def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Replace this shard's whole state with a snapshot (see ``snapshot``)."""
        if meta["num_shards"] != self.num_shards:
            raise FailedPrecondition(f"checkpoint is of a {meta['num_shards']}-shard job; this is shard "
                                     f"{self.shard_index} of {self.num_shards}")
        s = snapshot.decode(version, meta, tensors)
        with self._cond:
            self._settle()
            self.pullcache.clear()
            self._tensors = TensorTable(self.shard_index, s.entries)
            self.membership.restore(s.workers, s.evicted, s.left, s.num_workers)
            self.worker_clocks = s.worker_clocks
            self._sync = s.sync
            ap = self.applier
            ap.remedy, ap.scaler, self._scaling_config = s.remedy, s.scaler, scaling_config(s.scaler)
            self._policy = (make_policy(self._sync, s.num_workers, ap.pool.recycle)
                            if self._sync is not None and s.num_workers else None)
            if self._policy is not None:
                if s.held is not None:
                    self._policy.restore_held(s.held)
                self._policy.track_live(self.live_workers())
            for k, v in s.counters.items():
                setattr(self, k, v)
            self.staleness_counts = s.staleness_counts
            self.version = version
            self.epoch = max(self.epoch, s.epoch)
            ap.stale_weights = s.stale_weights
            for e in s.entries.values():
                if e.spec.split and self.peers is not None:
                    self.peers.set_addresses(e.spec.peers)
            self._cond.notify_all()
        log.info("shard %d: restored version %d (%d tensors)", self.shard_index, version, len(s.entries))

    def state_hash(self) -> str:
        """A digest of weights, optimizer state and version: equal iff the state is."""
        h = hashlib.sha256()
        with self._cond:
            self._settle()
            h.update(str(self.version).encode())
            for name in sorted(self._tensors):
                for start, part in sorted(self._tensors[name].parts.items()):
                    h.update(f"{name}:{start}".encode())
                    h.update(part.weight.numpy().tobytes())
                    for k in sorted(part.state):
                        h.update(k.encode())
                        h.update(part.state[k].numpy().tobytes())
        return h.hexdigest()

    def stats(self) -> ShardStats:
        with self._cond:
            m, rep = self.membership, self.replicator
            return ShardStats(
                shard_index=self.shard_index, num_shards=self.num_shards, version=self.version,
                sync=str(self._sync) if self._sync else "", num_workers=m.num_workers or 0,
                registered_workers=sorted(m.workers), evicted_workers=sorted(m.evicted),
                evictions_total=m.evictions_total, left_workers=sorted(m.left), leaves_total=m.leaves_total,
                epoch=self.epoch, recovering=self.recovering, waiting_pulls=self.waiting,
                tensors=[TensorStats(e.spec.to_proto(), e.weight_bytes, e.optimizer_state_bytes)
                         for e in (self._tensors[n] for n in sorted(self._tensors))],
                pushes_total=self.pushes_total, applied_updates_total=self.applied_updates_total,
                gradients_applied_total=self.gradients_applied_total, push_bytes_total=self.push_bytes_total,
                pull_bytes_total=self.pull_bytes_total, pulls_total=self.pulls_total,
                staleness_counts=dict(self.staleness_counts), skipped_steps_total=self.skipped_steps_total,
                sync_switches_total=self.sync_switches_total, staleness_remedy=str(self.remedy),
                checkpoint_versions=self.checkpoint_versions(), duplicate_pushes_total=self.duplicate_pushes_total,
                loss_scale=self.loss_scale, worker_clocks=dict(self.worker_clocks), role=str(self.role),
                backup=rep.address if rep else "", replica_state=str(rep.state) if rep else str(ReplicaState.NONE),
                replicated_ops_total=rep.ops_total if rep else self.replica_seq,
                replication_lag_ops=rep.lag if rep else 0, promotions_total=self.promotions_total)
