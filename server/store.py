"""ShardStore: one shard, a facade over the parts it owns, each an object with its own state.

Pure Python/torch, no gRPC: other servers are reached through the ``Peers``
and ``ReplicaLink`` interfaces it is given (server/replication/peers.py). The store owns
its parts as objects, each holding its own state and given, at
construction, the store's lock and what it needs (a Protocol or a
callable); no part reaches another through the store::

    ShardStore                 store.py: the lock, the wiring, stats, snapshot/restore, rollback,
    |                          the RPCs answered in one call; the Replayer of the replica side
    |- path: DataPath          datapath/path.py: configure, join, submit, pull, set_sync over the parts below
    |- table: TensorTable      table.py: the tensors (fp32 master weights, optimizer state)
    |- job: Job                job.py: version, epoch, sync mode and policy, clocks, the waits
    |- leases: Leases          membership.py: who is registered, evicted, gone; the lease reaper
    |- applier: Applier        datapath/apply.py: the optimizer step, remedies, loss scaler, step counters
    |- reader: Reader          datapath/reader.py: reads, the Pull framing cache, reads in progress
    |- checkpointer            checkpoint.py: checkpoint files and their schedule
    |- rows: RowTables         rows/tables.py: row tables, pulled and pushed by key (docs/sparse.md)
    '- replica: ReplicaSide    replication/state.py: role, replicator, replay and takeover; the parts' Recorder

and the snapshot codec (replication/snapshot.py), the sync policies (sync.py), the
role and op enums (replication/roles.py). Callers name the part that owns what they
want (``store.job.version``, ``store.path.submit(...)``,
``store.replica.role``): the store forwards nothing. ``Replay``, at the
end, is the ``Replayer`` its replica side is given.

Versions: a shard starts at version 0 and adds one per optimizer step it
applies (under BSP, one per step of the job; under ASP, one per gradient).

LOCK ORDER (a lock may be taken while holding only those listed before it)::

    checkpointer.lock   one checkpoint write or rollback at a time (holds it over disk I/O)
    replica's replay lock  backup: one replicated op replayed, or a promotion, at a time
    _cond         the store's lock and condition, given to every part: tensors, version,
                  epoch, policy, membership, counters. Every wait on it has a timeout.
    leaf locks    taken under _cond, taking nothing else: StagingPool's, the
                  ExchangeTable's, the Replicator's (record), PeerChannels'
    Framing._cond a large Pull's framed responses (datapath/reader.py); taken with no
                  other lock held

A large Pull frames (or, same-host, copies) the weights outside _cond,
counted in ``reader.reading``; a step waits for it to be 0 before it
changes weights in place (``Reader.before_write``, see datapath/reader.py).

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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardps.protos.results import PushResult
from shardps.protos.stats import ShardStats, TensorStats
from shardps.server.checkpoint import Checkpointer
from shardps.server.datapath.apply import Applier
from shardps.server.datapath.path import DataPath
from shardps.server.datapath.reader import Reader
from shardps.server.errors import FailedPrecondition
from shardps.server.job import Job
from shardps.server.membership import DEFAULT_LEASE_S, Clock, Leases, Membership
from shardps.server.parked import Signal
from shardps.server.replication.peers import Peers, ReplicaLink
from shardps.server.replication.roles import OpKind, ReplicaState, Role
from shardps.server.replication.snapshot import COUNTERS, ShardState, decode, encode, state_hash
from shardps.server.replication.state import ReplicaSide
from shardps.server.rows.tables import RowTables
from shardps.server.scaling import LossScaler, scaling_config
from shardps.server.sync import PartKey, make_policy
from shardps.server.table import TensorSpec, TensorTable

__all__ = ["DEFAULT_LEASE_S", "PushResult", "ShardStore", "TensorSpec"]

log = logging.getLogger("shardps.server")

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
        self.replica = replica = ReplicaSide(shard_index, num_shards, cond, Replay(self), role=Role(role),
                                             replica_link=replica_link)
        membership = Membership(shard_index, lease_s, clock)
        self.job = job = Job(shard_index, cond, live=membership.live, moved_to=lambda: replica.moved_to,
                             checkpoints=ck.versions)
        self.leases = leases = Leases(cond, replica, membership, on_live_changed=lambda live: self._live_changed(live),
                                      may_evict=lambda: replica.role is Role.PRIMARY,
                                      clock_of=lambda w: job.worker_clocks.get(w, -1) + 1)
        self.applier = applier = Applier(shard_index, cond, table, peers=peers, exchange_timeout_s=exchange_timeout_s)
        self.reader = reader = Reader(shard_index, cond, table, job, settle=applier.settle,
                                      loss_scale=lambda: applier.loss_scale,
                                      on_read=lambda worker, names: path.on_read(worker, names))
        self.rows = RowTables(cond, lambda args, tensors: replica.record(OpKind.ROWS, args, tensors),  # rows/tables.py
                              lambda: replica.recording, gone=lambda: membership.evicted | membership.left,
                              halted=lambda: job.recovering or job.closing, check_epoch=job.check_same_epoch)
        self.path = path = DataPath(shard_index, num_shards, cond, table=table, job=job, leases=leases,
                                    applier=applier, reader=reader, replica=replica, checkpointer=ck,
                                    checkpoint=self._checkpoint_taken, clock=clock)
        if sync is not None or num_workers is not None:
            if sync is None or num_workers is None:
                raise ValueError("give both sync and num_workers, or neither")
            self.path.configure(num_workers, sync)



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

    def _live_changed(self, live: set[int]) -> None:
        """Under the lock: the live workers changed: the dense barrier and every row table's may be complete."""
        self.path.live_changed(live)
        self.rows.live_changed()

    def _counter_part(self, counter: str) -> object:
        """The part that keeps ``counter`` (one of snapshot.COUNTERS)."""
        parts = (self.job, self.applier, self.reader, self.leases)
        return next(p for p in parts if hasattr(p, counter))

    def clocks(self) -> dict[int, int]:
        """Each live worker's clock: the number of steps it has pushed (0 before its first)."""
        with self._cond:
            return self.job.clocks()

    # -- what one RPC asks, in one call (server/service.py decodes and encodes around these) ------

    def heartbeat(self, worker_id: int) -> tuple[int, list[int], str]:
        """Renew ``worker_id``'s lease: (version, live workers, where the backup lives or "")."""
        self.replica.check_serving()
        self.leases.membership.check_registered(worker_id)  # an evicted worker learns it here
        self.leases.touch(worker_id)
        rep = self.replica.replicator
        backup = rep.address if rep is not None and rep.state != ReplicaState.NONE else ""
        return self.job.version, sorted(self.leases.live()), backup

    def goodbye(self, worker_id: int) -> tuple[int, list[int]]:
        """``worker_id`` leaves the job (``leave``), once the backup knows: (version, live workers)."""
        self.replica.check_serving()
        self.leases.leave(worker_id)
        self.replica.replicated()
        return self.job.version, sorted(self.leases.live())

    def recover(self, version: int, epoch: int) -> tuple[int, int]:
        """Roll back to the checkpoint at ``version`` in ``epoch`` (``rollback``), once the backup holds it."""
        self.replica.check_serving()
        result = self.rollback(version, epoch)
        self.replica.replicated()
        return result

    def switch_sync(self, sync: str) -> tuple[str, int, int]:
        """``set_sync``, once the backup holds it: (the sync mode now, version, the job's sync switch)."""
        self.replica.check_serving()
        spec = self.path.set_sync(sync)
        self.replica.replicated()
        return str(spec), self.job.version, self.job.sync_switches_total

    def checkpoint_request(self) -> tuple[int, str]:
        """Write a checkpoint now: (version, path)."""
        self.replica.check_serving()
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
        (server/experts/heldgrads.py), for a backup's sync (a checkpoint leaves them out)."""
        self.applier.settle()
        m, job, ap = self.leases.membership, self.job, self.applier
        version, meta, tensors = encode(ShardState(
            version=job.version, num_shards=self.num_shards, sync=job.sync, num_workers=m.num_workers,
            workers=sorted(m.workers), evicted=sorted(m.evicted), left=sorted(m.left), skips=sorted(m.skips),
            worker_clocks=job.worker_clocks, scaler=ap.scaler, remedy=ap.remedy, epoch=job.epoch,
            entries=self.table.entries, held=job.policy.held_state() if job.policy else None,
            counters={k: getattr(self._counter_part(k), k) for k in COUNTERS}, staleness_counts=ap.staleness_counts,
            stale_weights=ap.stale_weights))
        meta["rows"], row_tensors = self.rows.snapshot_locked()  # row tables (server/rows/tables.py): their own keys
        if holds:
            meta["row_holds"], held = self.rows.held.state()
            row_tensors.update(held)
        return version, meta, {**tensors, **row_tensors}

    def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                epoch: int | None = None) -> None:
        """Replace this shard's whole state with a snapshot (see ``snapshot``), part by part. ``epoch``: a
        rollback's, entered under the same hold of the lock as the state (``rollback``)."""
        if meta["num_shards"] != self.num_shards:
            raise FailedPrecondition(f"checkpoint is of a {meta['num_shards']}-shard job; this is shard "
                                     f"{self.shard_index} of {self.num_shards}")
        s = decode(version, meta, tensors)
        row_tables = self.rows.built(meta.get("rows") or {}, tensors)
        if "row_holds" in meta:  # a backup's sync (``snapshot_locked(holds=True)``)
            self.rows.held.load(meta["row_holds"], tensors)
        with self._cond:
            ap, job = self.applier, self.job
            ap.settle()
            # As before a step: no Pull copying the weights outside the lock, none framed or shared from them
            # (a Pull's shared buffer is of "this version": a rollback's version was one before, other weights).
            self.reader.before_write()
            self.table.replace(s.entries)
            self.leases.membership.restore(s.workers, s.evicted, s.left, s.num_workers, s.skips)
            self.rows.install_locked(row_tables)  # its barriers track the workers restored just above
            job.worker_clocks, job.sync = s.worker_clocks, s.sync
            ap.remedy, ap.scaler, ap.scaling_configured = s.remedy, s.scaler, scaling_config(s.scaler)
            job.policy = (make_policy(job.sync, s.num_workers, ap.pool.recycle)
                          if job.sync is not None and s.num_workers else None)
            if job.policy is not None:
                if s.held is not None:
                    job.policy.restore_held(s.held)
                job.policy.track_live(self.leases.live())
            for k, v in s.counters.items():
                setattr(self._counter_part(k), k, v)
            ap.staleness_counts = s.staleness_counts
            job.version = version
            job.epoch = max(job.epoch, s.epoch)
            if epoch is not None:
                job.epoch = max(epoch, job.epoch + 1)
                job.recovering = False
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

    def _checkpoint_taken(self) -> Callable[[], str | None]:
        """Under the lock (a step made a checkpoint due): take the snapshot now; what writes it once the lock
        is released (unless the shard rolled back in between: ``Checkpointer.write_taken``)."""
        taken, epoch = self.snapshot_locked(), self.job.epoch
        return lambda: self.checkpointer.write_taken(taken, lambda: self.job.epoch == epoch and not self.job.recovering)

    def rollback(self, version: int, epoch: int) -> tuple[int, int]:
        """Restore the checkpoint at ``version`` and enter ``epoch`` (no-op if already there).

        Waits in progress end with ABORTED, so their workers resync too. The state and the epoch change
        under one hold of the lock: a request of the epoch before never meets the restored state (a push
        taken in there would outlive the rollback, into the new epoch).
        """
        ck, job = self.checkpointer, self.job
        with ck.lock:
            if epoch <= job.epoch and not job.recovering:
                return job.version, job.epoch
            c = ck.load(version)
            self.restore(c.version, c.meta, c.tensors(), epoch=epoch)
            with self._cond:
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


class Replay:
    """The ``Replayer`` the replica side is given (server/replication/state.py): each op replayed through the part that
    answers the same request on a primary (the same code path), the snapshots through the store."""

    def __init__(self, store: ShardStore) -> None:
        self._store = store

    @property
    def version(self) -> int:
        return self._store.job.version

    @property
    def epoch(self) -> int:
        return self._store.job.epoch

    def snapshot_locked(self, *, holds: bool = False) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        return self._store.snapshot_locked(holds=holds)

    def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self._store.restore(version, meta, tensors)

    def split_names_locked(self) -> list[str]:
        return self._store.table.split_names()

    def renew_leases_locked(self) -> None:
        self._store.leases.membership.renew_all()

    def configure(self, num_workers: int, sync: str, loss_scaling: LossScaler | None = None,
                  remedy: str | None = None) -> Any:
        return self._store.path.configure(num_workers, sync, loss_scaling, remedy)

    def register_worker(self, worker_id: int) -> None:
        self._store.leases.register(worker_id)

    def register_tensors(self, specs: Sequence[TensorSpec], values: dict[PartKey, torch.Tensor] | None) -> list[str]:
        return self._store.path.register_tensors(specs, values)

    def submit(self, worker_id: int, step: int, base_version: int, grads: Any, nbytes: int = 0, *,
               found_inf: bool = False, checked: bool = False, weights: Any = None, sync: str = "",
               sync_switch: int = 0) -> Any:
        return self._store.path.submit(worker_id, step, base_version, grads, nbytes, found_inf=found_inf,
                                       checked=checked, weights=weights, sync=sync, sync_switch=sync_switch)

    def leave(self, worker_id: int) -> bool:
        return self._store.leases.leave(worker_id)

    def set_sync(self, sync: str, switch: int | None = None) -> Any:
        return self._store.path.set_sync(sync, switch)

    def evict(self, workers: list[int]) -> None:
        """Evict ``workers`` as the primary did."""
        self._store.leases.evict(workers)

    def remember_pulled(self, worker_id: int, names: list[str]) -> None:
        """dc-asgd keeps the weights ``worker_id`` pulled, as the primary did."""
        with self._store._cond:
            self._store.path.remember_locked(worker_id, names)

    def replay_rows(self, args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self._store.rows.replay(args, tensors)
