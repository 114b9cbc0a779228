"""ShardStore: one shard, a facade over the parts it owns, each an object with its own state.

Pure Python/torch, no gRPC: other servers are reached through the ``Peers``
and ``ReplicaLink`` interfaces it is given (server/peers.py). The store owns
its parts as objects, each holding its own state and given, at
construction, the store's lock and what it needs (a Protocol or a
callable); no part reaches another through the store::

    ShardStore                 store.py: the lock, the wiring, stats, snapshot/restore, rollback,
    |                          the RPCs answered in one call; the Replayer of the replica side
    |- path: DataPath          datapath.py: configure, join, submit, pull, set_sync over the parts below
    |- table: TensorTable      table.py: the tensors (fp32 master weights, optimizer state)
    |- job: Job                job.py: version, epoch, sync mode and policy, clocks, the waits
    |- leases: Leases          membership.py: who is registered, evicted, gone; the lease reaper
    |- applier: Applier        apply.py: the optimizer step, remedies, loss scaler, step counters
    |- reader: Reader          pullcache.py: reads, the Pull framing cache, reads in progress
    |- checkpointer            checkpoint.py: checkpoint files and their schedule
    |- rows: RowTables         rows.py: row tables, pulled and pushed by key (docs/sparse.md)
    '- replica: ReplicaSide    replica.py: role, replicator, replay and takeover; the parts' Recorder

and the snapshot codec (snapshot.py), the sync policies (sync.py), the
role and op enums (roles.py). The store's public attributes of earlier
versions (``version``, ``pushes_total``, ``role``, ...) and methods
(``submit``, ``pull``, ``promote``, ...) delegate to the part that owns them.

(Over 400 lines: the wiring of the parts, the delegations that keep the
store's surface, and the snapshot/restore that gathers every part's state
belong to the facade.)

Versions: a shard starts at version 0 and adds one per optimizer step it
applies (under BSP, one per step of the job; under ASP, one per gradient).

LOCK ORDER (a lock may be taken while holding only those listed before it)::

    checkpointer.lock   one checkpoint write or rollback at a time (holds it over disk I/O)
    replica's replay lock  backup: one replicated op replayed, or a promotion, at a time
    _cond         the store's lock and condition, given to every part: tensors, version,
                  epoch, policy, membership, counters. Every wait on it has a timeout.
    leaf locks    taken under _cond, taking nothing else: StagingPool's, the
                  ExchangeTable's, the Replicator's (record), PeerChannels'
    Framing._cond a large Pull's framed responses (pullcache.py); taken with no
                  other lock held

A large Pull frames (or, same-host, copies) the weights outside _cond,
counted in ``reader.reading``; a step waits for it to be 0 before it
changes weights in place (``Reader.before_write``, see pullcache.py).

No network call is made while holding _cond or the replay lock: a split
tensor's step releases _cond around ``Peers.fetch`` (``applier.applying``
keeps every other reader and writer of the tensors out meanwhile, see
``Applier.settle``); a promotion asks the primary's health with no lock
held, then checks its role again. (The checkpoint lock is held over the
checkpoint's disk writes, never over a call to another server.)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch

from shardps.protos.results import PushResult
from shardps.protos.stats import ShardStats, TensorStats
from shardps.protos.syncspec import SyncSpec
from shardps.server.apply import Applier
from shardps.server.checkpoint import Checkpointer
from shardps.server.datapath import DataPath
from shardps.server.errors import FailedPrecondition
from shardps.server.job import Job
from shardps.server.membership import DEFAULT_LEASE_S, Clock, Leases, Membership
from shardps.server.parked import Signal
from shardps.server.peers import ExchangeTable, Peers, ReplicaLink, ReplicaSink
from shardps.server.pullcache import PullCache, Reader
from shardps.server.remedies import Remedy
from shardps.server.replica import ReplicaSide
from shardps.server.roles import OpKind, ReplicaState, Role
from shardps.server.rows import RowTables
from shardps.server.scaling import scaling_config
from shardps.server.snapshot import COUNTERS, ShardState, decode, encode, state_hash
from shardps.server.sync import make_policy
from shardps.server.table import TensorSpec, TensorTable

__all__ = ["DEFAULT_LEASE_S", "PushResult", "ShardStore", "TensorSpec"]

log = logging.getLogger("shardps.server")

T = TypeVar("T")


class Via(Generic[T]):
    """A store attribute that is the same-named attribute (or ``name``) of one of its parts."""

    def __init__(self, part: str, name: str = "") -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, obj: None, owner: type) -> Via[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object, owner: type) -> T | Via[T]:
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self.part), self.name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class ShardStore:
    """The state of one shard, made of parts. See the module docstring for the contract."""

    def __init__(self, shard_index: int = 0, num_shards: int = 1, *, sync: str | None = None,
                 num_workers: int | None = None, exchange_timeout_s: float = 60.0,
                 lease_s: float = DEFAULT_LEASE_S, role: str = Role.PRIMARY, clock: Clock = time.monotonic,
                 peers: Peers | None = None, replica_link: ReplicaLink | None = None) -> None:
        if role not in (Role.PRIMARY, Role.BACKUP):
            raise ValueError(f"role must be 'primary' or 'backup', got {role!r}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.clock = clock
        self._cond = cond = Signal()  # a Condition that also releases Pulls parked without a thread
        # The parts, each given what it needs. Leases and the reader call back into the data path, built last
        # (``path`` below is bound by the time any request runs).
        path: DataPath
        self.table = table = TensorTable(shard_index)
        self.checkpointer = ck = Checkpointer(shard_index)
        self.replica = replica = ReplicaSide(shard_index, num_shards, cond, self, role=Role(role),
                                             replica_link=replica_link)
        membership = Membership(shard_index, lease_s, clock)
        self.job = job = Job(shard_index, cond, live=membership.live, moved_to=lambda: replica.moved_to,
                             checkpoints=ck.versions)
        self.leases = leases = Leases(cond, replica, membership, on_live_changed=lambda live: path.live_changed(live),
                                      may_evict=lambda: replica.role is Role.PRIMARY,
                                      clock_of=lambda w: job.worker_clocks.get(w, -1) + 1)
        self.applier = applier = Applier(shard_index, cond, table, peers=peers, exchange_timeout_s=exchange_timeout_s)
        self.reader = reader = Reader(shard_index, cond, table, job, settle=applier.settle,
                                      loss_scale=lambda: applier.loss_scale,
                                      on_read=lambda worker, names: path.on_read(worker, names))
        self.rows = RowTables(cond, lambda args, tensors: replica.record(OpKind.ROWS, args, tensors),  # rows.py
                              lambda: replica.recording, gone=lambda: membership.evicted | membership.left)
        self.path = path = DataPath(shard_index, num_shards, cond, table=table, job=job, leases=leases,
                                    applier=applier, reader=reader, replica=replica, checkpointer=ck,
                                    checkpoint=self.checkpoint_now, clock=clock)
        # What the store does, each the method of the part that does it (its signature and docstring).
        self.configure, self.join, self.register_tensors = path.configure, path.join, path.register_tensors
        self.wait_for_tensors, self.takes_chunked, self.submit = path.wait_for_tensors, path.takes_chunked, path.submit
        self.pull, self.weights_now, self.set_sync = path.pull, path.weights_now, path.set_sync
        self.pull_slices = path.pull_slices
        self.spec, self.staging = table.spec, applier.pool.take
        self.check_epoch, self.wait_version, self.wait_clock = job.check_epoch, job.wait_version, job.wait_clock
        self.check_same_epoch = job.check_same_epoch
        self.register_worker, self.leave, self.touch, self.live_workers = (leases.register, leases.leave,
                                                                           leases.touch, leases.live)
        self.check_worker_id = membership.check_worker_id
        self.evict_expired, self.start_reaper, self.stop_reaper = (leases.evict_expired, leases.start_reaper,
                                                                   leases.stop_reaper)
        self.read, self.read_into = reader.read, reader.read_into
        self.export_state, self.weights = reader.export_state, reader.weights
        self.checkpoint_versions, self.enable_checkpoints = ck.versions, ck.enable
        self.check_serving, self.replicated, self.attach_replica = (replica.check_serving, replica.replicated,
                                                                    replica.attach_replica)
        self.start_replicated, self.stop_replication = replica.start_replicated, replica.stop_replication
        self.apply_replica, self.promote, self.take_over = replica.apply_ops, replica.promote, replica.take_over
        self.replay_rows = self.rows.replay
        if sync is not None or num_workers is not None:
            if sync is None or num_workers is None:
                raise ValueError("give both sync and num_workers, or neither")
            self.configure(num_workers, sync)

    # The attributes of earlier versions, now each part's own (read by service.py, metrics, tests, tools).
    version: Via[int] = Via("job")
    epoch: Via[int] = Via("job")
    recovering: Via[bool] = Via("job")
    closing: Via[bool] = Via("job")
    waiting: Via[int] = Via("job")
    worker_clocks: Via[dict[int, int]] = Via("job")
    pushes_total: Via[int] = Via("job")
    duplicate_pushes_total: Via[int] = Via("job")
    push_bytes_total: Via[int] = Via("job")
    sync_switches_total: Via[int] = Via("job")
    sync: Via[SyncSpec | None] = Via("job")
    membership: Via[Membership] = Via("leases")
    lease_s: Via[float] = Via("leases")
    evictions_total: Via[int] = Via("leases")
    leaves_total: Via[int] = Via("leases")
    peers: Via[Peers | None] = Via("applier")
    exchange: Via[ExchangeTable] = Via("applier")
    exchange_timeout_s: Via[float] = Via("applier")
    applied_updates_total: Via[int] = Via("applier")
    gradients_applied_total: Via[int] = Via("applier")
    skipped_steps_total: Via[int] = Via("applier")
    apply_seconds_total: Via[float] = Via("applier")
    staleness_counts: Via[Counter[int]] = Via("applier")
    on_apply: Via[list[Callable[[float], None]]] = Via("applier")
    remedy: Via[Remedy] = Via("applier")
    loss_scale: Via[float] = Via("applier")
    pullcache: Via[PullCache] = Via("reader", "cache")
    frame_inline_bytes: Via[int] = Via("reader")
    writers_waiting: Via[int] = Via("reader")
    pull_bytes_total: Via[int] = Via("reader")
    pulls_total: Via[int] = Via("reader")
    checkpoints_total: Via[int] = Via("checkpointer")
    role: Via[Role] = Via("replica")
    address: Via[str] = Via("replica")
    replicator: Via[ReplicaSink | None] = Via("replica")
    replica_link: Via[ReplicaLink | None] = Via("replica")
    replica_timeout_s: Via[float] = Via("replica")
    moved_to: Via[str] = Via("replica")
    primary_address: Via[str] = Via("replica")
    replica_seq: Via[int] = Via("replica")
    replica_synced: Via[bool] = Via("replica")
    promotions_total: Via[int] = Via("replica")

    @property
    def num_workers(self) -> int | None:
        return self.leases.membership.num_workers

    @property
    def framed_hits_total(self) -> int:
        return self.reader.cache.hits_total

    def connect(self, peers: Peers | None = None, replica_link: ReplicaLink | None = None) -> None:
        """Give the store its ways to other servers (at start-up; see service.connect)."""
        with self._cond:
            if peers is not None:
                self.applier.peers = peers
                self.applier.add_peers(self.table.values())  # split tensors restored before the store was served
            if replica_link is not None:
                self.replica.replica_link = replica_link

    def names(self) -> list[str]:
        """The names of the tensors held, sorted."""
        with self._cond:
            return sorted(self.table)

    def clocks(self) -> dict[int, int]:
        """Each live worker's clock: the number of steps it has pushed (0 before its first)."""
        with self._cond:
            return self.job.clocks()

    # -- what one RPC asks, in one call (server/service.py decodes and encodes around these) ------

    def heartbeat(self, worker_id: int) -> tuple[int, list[int], str]:
        """Renew ``worker_id``'s lease: (version, live workers, where the backup lives or "")."""
        self.check_serving()
        self.leases.membership.check_registered(worker_id)  # an evicted worker learns it here
        self.leases.touch(worker_id)
        rep = self.replica.replicator
        backup = rep.address if rep is not None and rep.state != ReplicaState.NONE else ""
        return self.job.version, sorted(self.leases.live()), backup

    def goodbye(self, worker_id: int) -> tuple[int, list[int]]:
        """``worker_id`` leaves the job (``leave``), once the backup knows: (version, live workers)."""
        self.check_serving()
        self.leases.leave(worker_id)
        self.replicated()
        return self.job.version, sorted(self.leases.live())

    def recover(self, version: int, epoch: int) -> tuple[int, int]:
        """Roll back to the checkpoint at ``version`` in ``epoch`` (``rollback``), once the backup holds it."""
        self.check_serving()
        result = self.rollback(version, epoch)
        self.replicated()
        return result

    def switch_sync(self, sync: str) -> tuple[str, int, int]:
        """``set_sync``, once the backup holds it: (the sync mode now, version, the job's sync switch)."""
        self.check_serving()
        spec = self.set_sync(sync)
        self.replicated()
        return str(spec), self.job.version, self.job.sync_switches_total

    def checkpoint_request(self) -> tuple[int, str]:
        """Write a checkpoint now: (version, path)."""
        self.check_serving()
        path = self.checkpoint_now()
        return self.job.version, path

    def close(self) -> None:
        """Shutting down: waits in progress end with UNAVAILABLE, new requests are refused."""
        self.leases.signal_stop()
        self.job.close()

    # -- state: snapshots, checkpoints, rollback ---------------------------------------

    def snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        """Everything needed to restore this shard: (version, JSON-able meta, tensors).

        Weights, optimizer state, the gradients a barrier round holds, the
        version, each worker's last step (the exactly-once bookkeeping), the
        loss scaler and the counters. Tensors are copies taken under the lock.
        """
        with self._cond:
            return self.snapshot_locked()

    def snapshot_locked(self, *, holds: bool = False) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        """``snapshot`` with the lock held; ``holds``: with the expert gradients held for a step under way
        (server/heldgrads.py), for a backup's sync (a checkpoint leaves them out)."""
        self.applier.settle()
        m, job, ap = self.leases.membership, self.job, self.applier
        version, meta, tensors = encode(ShardState(
            version=job.version, num_shards=self.num_shards, sync=job.sync, num_workers=m.num_workers,
            workers=sorted(m.workers), evicted=sorted(m.evicted), left=sorted(m.left), skips=sorted(m.skips),
            worker_clocks=job.worker_clocks, scaler=ap.scaler, remedy=ap.remedy, epoch=job.epoch,
            entries=self.table.entries, held=job.policy.held_state() if job.policy else None,
            counters={k: getattr(self, k) for k in COUNTERS}, staleness_counts=ap.staleness_counts,
            stale_weights=ap.stale_weights))
        meta["rows"], row_tensors = self.rows.snapshot_locked()  # row tables (server/rows.py): their own keys
        if holds:
            meta["row_holds"], held = self.rows.held.state()
            row_tensors.update(held)
        return version, meta, {**tensors, **row_tensors}

    def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Replace this shard's whole state with a snapshot (see ``snapshot``), part by part."""
        if meta["num_shards"] != self.num_shards:
            raise FailedPrecondition(f"checkpoint is of a {meta['num_shards']}-shard job; this is shard "
                                     f"{self.shard_index} of {self.num_shards}")
        s = decode(version, meta, tensors)
        self.rows.restore(meta.get("rows") or {}, tensors)
        if "row_holds" in meta:  # a backup's sync (``snapshot_locked(holds=True)``)
            self.rows.held.load(meta["row_holds"], tensors)
        with self._cond:
            ap, job = self.applier, self.job
            ap.settle()
            self.reader.cache.clear()
            self.table.replace(s.entries)
            self.leases.membership.restore(s.workers, s.evicted, s.left, s.num_workers, s.skips)
            job.worker_clocks, job.sync = s.worker_clocks, s.sync
            ap.remedy, ap.scaler, ap.scaling_configured = s.remedy, s.scaler, scaling_config(s.scaler)
            job.policy = (make_policy(job.sync, s.num_workers, ap.pool.recycle)
                          if job.sync is not None and s.num_workers else None)
            if job.policy is not None:
                if s.held is not None:
                    job.policy.restore_held(s.held)
                job.policy.track_live(self.leases.live())
            for k, v in s.counters.items():
                setattr(self, k, v)
            ap.staleness_counts = s.staleness_counts
            job.version = version
            job.epoch = max(job.epoch, s.epoch)
            ap.stale_weights = s.stale_weights
            ap.add_peers(s.entries.values())
            self._cond.notify_all()
        log.info("shard %d: restored version %d (%d tensors)", self.shard_index, version, len(s.entries))

    def state_hash(self) -> str:
        """A digest of weights, optimizer state and version: equal iff the state is."""
        with self._cond:
            self.applier.settle()
            return state_hash(self.job.version, self.table.items())

    def checkpoint_now(self) -> str:
        """Write a checkpoint of the current state; return the path of its metadata."""
        return self.checkpointer.write(self.snapshot)

    def rollback(self, version: int, epoch: int) -> tuple[int, int]:
        """Restore the checkpoint at ``version`` and enter ``epoch`` (no-op if already there).

        Waits in progress end with ABORTED, so their workers resync too.
        """
        ck, job = self.checkpointer, self.job
        with ck.lock:
            if epoch <= job.epoch and not job.recovering:
                return job.version, job.epoch
            c = ck.load(version)
            self.restore(c.version, c.meta, c.tensors())
            with self._cond:
                job.epoch = max(epoch, job.epoch + 1)
                job.recovering = False
                ck.last_version = c.version
                self.replica.record_snapshot()
                self._cond.notify_all()
        log.warning("shard %d: rolled back to version %d, epoch %d", self.shard_index, version, job.epoch)
        return job.version, job.epoch

    def restore_latest(self, at_most: int | None = None) -> int | None:
        """Restore the newest complete checkpoint (at or below ``at_most``); its version, or None."""
        c = self.checkpointer.latest(at_most)
        if c is None:
            return None
        self.restore(c.version, c.meta, c.tensors())
        self.checkpointer.last_version = c.version
        return c.version

    # -- the Replayer the replica side is given (replica.py); its other methods are the data path's ---------

    def split_names_locked(self) -> list[str]:
        return self.table.split_names()

    def renew_leases_locked(self) -> None:
        self.leases.membership.renew_all()

    def evict(self, workers: list[int]) -> None:
        """Replayed: evict ``workers`` as the primary did."""
        with self._cond:
            self.leases.evict_locked(workers)

    def remember_pulled(self, worker_id: int, names: list[str]) -> None:
        """Replayed: dc-asgd keeps the weights ``worker_id`` pulled."""
        with self._cond:
            self.path.remember_locked(worker_id, names)

    def stats(self) -> ShardStats:
        """Every part's figures, of one moment (taken under the lock)."""
        with self._cond:
            m, rep, job, ap, rd = self.leases.membership, self.replica.replicator, self.job, self.applier, self.reader
            return ShardStats(
                shard_index=self.shard_index, num_shards=self.num_shards, version=job.version,
                sync=job.sync_text, num_workers=m.num_workers or 0,
                registered_workers=sorted(m.workers), evicted_workers=sorted(m.evicted),
                evictions_total=m.evictions_total, left_workers=sorted(m.left), leaves_total=m.leaves_total,
                epoch=job.epoch, recovering=job.recovering, waiting_pulls=job.waiting,
                tensors=[TensorStats(e.spec.to_proto(), e.weight_bytes, e.optimizer_state_bytes)
                         for e in (self.table[n] for n in sorted(self.table))],
                pushes_total=job.pushes_total, applied_updates_total=ap.applied_updates_total,
                gradients_applied_total=ap.gradients_applied_total, push_bytes_total=job.push_bytes_total,
                pull_bytes_total=rd.pull_bytes_total, pulls_total=rd.pulls_total,
                staleness_counts=dict(ap.staleness_counts), skipped_steps_total=ap.skipped_steps_total,
                sync_switches_total=job.sync_switches_total, staleness_remedy=str(ap.remedy),
                checkpoint_versions=self.checkpointer.versions(), duplicate_pushes_total=job.duplicate_pushes_total,
                loss_scale=ap.loss_scale, worker_clocks=dict(job.worker_clocks), role=str(self.replica.role),
                backup=rep.address if rep else "", replica_state=str(rep.state) if rep else str(ReplicaState.NONE),
                replicated_ops_total=rep.ops_total if rep else self.replica.replica_seq,
                replication_lag_ops=rep.lag if rep else 0, promotions_total=self.replica.promotions_total,
                push_received_bytes_total=job.received.total, row_tables=self.rows.table_stats())
