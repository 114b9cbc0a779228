"""ShardStore: one shard: its lock, version, epoch, the data path (submit, waits, reads) and sync switches.

Pure Python/torch, no gRPC: other servers are reached through the ``Peers``
and ``ReplicaLink`` interfaces it is given (server/peers.py). The parts it
is made of, each in its own module with the store's methods over it (a
``...Mixin`` the store inherits, using the store's lock as below): the
tensor table and registration (table.py), leases and membership
(membership.py), the apply step (apply.py), reads and the pull framing cache
(pullcache.py), the snapshot codec (snapshot.py), checkpoints and rollback
(checkpoint.py), the replica side (replica.py); the sync policy (sync.py).
What stays here: the lock, version, epoch, configure, submit, the waits,
set_sync, close and stats. (Over 400 lines: these all read and write the same
fields under ``_cond``; split further, one critical section would span files.)

Versions: a shard starts at version 0 and adds one per optimizer step it
applies (under BSP, one per step of the job; under ASP, one per gradient).

LOCK ORDER (a lock may be taken while holding only those listed before it)::

    _ckpt_lock    one checkpoint write or rollback at a time (holds it over disk I/O)
    _replay_lock  backup: one replicated op replayed, or a promotion, at a time
    _cond         the store's lock and condition: tensors, version, epoch, policy,
                  membership, counters. Every wait on it has a timeout.
    leaf locks    taken under _cond, taking nothing else: StagingPool's, the
                  ExchangeTable's, the Replicator's (record), PeerChannels'
    Framing._cond a large Pull's framed responses (pullcache.py); taken with no
                  other lock held

A large Pull frames (or, same-host, copies) the weights outside _cond,
counted in ``_reading``; a step waits for ``_reading == 0`` before it
changes weights in place (``_await_reads``, see pullcache.py).

No network call is made while holding _cond or _replay_lock: a split
tensor's step releases _cond around ``Peers.fetch`` (``_applying`` keeps
every other reader and writer of the tensors out meanwhile, see
``_settle``); a promotion asks the primary's health with no lock held, then
checks its role again. (_ckpt_lock is held over the checkpoint's disk
writes, never over a call to another server.)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from shardps.protos import codec
from shardps.protos.results import PushResult, Registered
from shardps.protos.shm import Segment
from shardps.protos.stats import ShardStats, TensorStats
from shardps.protos.syncspec import SyncSpec
from shardps.server.apply import Applier, ApplyMixin, scaling_config
from shardps.server.checkpoint import CheckpointMixin
from shardps.server.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    StoreError,
    Unavailable,
)
from shardps.server.membership import DEFAULT_LEASE_S, Clock, Membership, MembershipMixin, Reaper
from shardps.server.peers import ExchangeTable, Peers, ReplicaLink, ReplicaSink
from shardps.server.pullcache import FRAME_INLINE_BYTES, Framing, Item, PullCache, ReadMixin, payload_bytes
from shardps.server.remedies import Remedy
from shardps.server.replica import (
    DEFAULT_REPLICA_TIMEOUT_S,
    OpKind,
    ReplicaMixin,
    ReplicaState,
    Role,
)
from shardps.server.scaling import LossScaler, unscale_and_check
from shardps.server.snapshot import SnapshotMixin, pack, part_keys
from shardps.server.sync import Contribution, Grads, Received, SyncPolicy, make_policy, materialize
from shardps.server.table import TableMixin, TensorSpec, TensorTable

__all__ = ["DEFAULT_LEASE_S", "PushResult", "ShardStore", "TensorSpec"]

log = logging.getLogger("shardps.server")

# A Push that asks for the weights too (PushRequest.pull_after) gets them from a shard holding at most this
# many bytes of them (in the wire dtype asked): a small model's step in one call.
SMALL_PULL_BYTES = 1 << 20


class ShardStore(TableMixin, MembershipMixin, ApplyMixin, ReadMixin, CheckpointMixin, SnapshotMixin, ReplicaMixin):
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
        self._reading = 0  # Pulls framing or copying weights outside _cond (pullcache.py); steps wait for 0
        self.writers_waiting = 0  # steps waiting for those Pulls
        self.frame_inline_bytes = FRAME_INLINE_BYTES  # larger Pulls are framed outside _cond
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

    def connect(self, peers: Peers | None = None, replica_link: ReplicaLink | None = None) -> None:
        """Give the store its ways to other servers (at start-up; see service.connect)."""
        with self._cond:
            if peers is not None:
                self.peers = peers
                for e in self._tensors.values():  # split tensors restored before the store was served
                    if e.spec.split:
                        peers.set_addresses(e.spec.peers)
            if replica_link is not None:
                self.replica_link = replica_link

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
    def framed_hits_total(self) -> int:
        return self.pullcache.hits_total

    def join(self, worker_id: int, num_workers: int, sync: str, scaling: LossScaler | None, remedy: str,
             specs: list[TensorSpec], values: Grads | None, timeout: float) -> Registered:
        """A worker's Register (decoded by server/wire.py): the job's settings agreed (``configure``), its
        tensors created from ``values`` (worker 0's) or, with ``values=None``, waited for up to ``timeout``;
        its lease started. Answered once the backup holds it."""
        mode = self.configure(num_workers, sync, scaling, remedy)
        self.check_worker_id(worker_id)
        created: list[str] = []
        if values is not None:
            created = self.register_tensors(specs, values)
        else:
            self.wait_for_tensors([s.name for s in specs], timeout)
            self.register_tensors(specs, None)
        self.register_worker(worker_id)
        self.replicated()
        log.info("shard %d: worker %d registered (%d tensors, %d created)",
                 self.shard_index, worker_id, len(specs), len(created))
        with self._cond:
            rep = self.replicator
            return Registered(self.version, self.shard_index, self.num_shards, str(mode), created, self.loss_scale,
                              self.worker_clocks.get(worker_id, -1) + 1, self.lease_s, self.epoch,
                              rep.address if rep else "")

    def takes_chunked(self, loss_scale: float) -> bool:
        """Whether a Push with ``loss_scale`` is best handed to ``submit`` still in its chunks (``Chunked``).

        True when it would be stepped from them as they are: a policy that passes gradients through (asp),
        nothing to unscale, no backup to send them to. Otherwise ``submit`` copies them into fp32 buffers,
        which costs less while each chunk is still in cache, as it arrives. A hint: ``submit`` takes either.
        """
        policy = self._policy
        return not loss_scale and self.replicator is None and policy is not None and policy.passes_through

    def submit(self, worker_id: int, step: int, base_version: int, grads: Received,
               nbytes: int = 0, *, found_inf: bool = False, loss_scale: float = 0.0,
               epoch: int | None = None, checked: bool = False) -> PushResult:
        """Hand one worker's gradient of ``step`` to the sync policy; apply what is due.

        ``grads`` maps (name, part start) to fp32 tensors the store may keep
        and modify, or to gradients still in their received chunks
        (``Chunked``, read only; see ``takes_chunked``). ``checked``: the
        caller has already set ``found_inf`` for any inf/nan in them. A
        gradient computed with a loss scale is unscaled here
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
        # Gradients still in their chunks stay so only to be stepped from as they are (takes_chunked);
        # anything else gets fp32 buffers, outside the lock (a no-op for fp32 tensors).
        fp32 = None if checked and self.takes_chunked(loss_scale) else materialize(grads, self.staging)
        if fp32 is not None:
            grads = fp32
            # Unscale and check outside the lock: the buffers are this request's own. ``checked``:
            # the caller already looked at every value (the Push assembly does, chunk by chunk).
            if loss_scale or not checked:
                found_inf = unscale_and_check(list(fp32.values()), loss_scale) or found_inf
        # The backup replays the gradient as taken in here (unscaled); packed (copied) before the sync
        # policy may sum other workers' gradients into these buffers.
        packed = pack(part_keys(fp32)) if self.replicator and fp32 is not None else None
        with self._cond:
            self._settle()
            self._await_reads()  # before the policy takes the gradient: the step below changes weights in place
            self.check_epoch(epoch)
            policy = self._policy
            assert policy is not None  # registered workers imply a job
            if not policy.passes_through:  # switched to a barrier since takes_chunked: fp32 buffers after all
                grads = materialize(grads, self.staging)
            last = self.worker_clocks.get(worker_id, -1)
            if step <= last:  # a retry of a push already taken in
                self.pushes_total += 1
                self.duplicate_pushes_total += 1
                ready = self.version + (1 if policy.holds(worker_id) else 0)
                return PushResult(self.version, applied=False, duplicate=True, sync=str(self.sync or ""),
                                  loss_scale=self.loss_scale, ready_version=ready)
            if step != last + 1:
                raise FailedPrecondition(
                    f"worker {worker_id} pushed step {step}, but its last step on shard {self.shard_index} "
                    f"was {last}: steps go up by one"
                )
            if self.replicator is not None:
                if packed is None:  # a backup was attached in between
                    grads = fp32 = materialize(grads, self.staging)
                    packed = pack(part_keys(fp32))
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
            result = PushResult(self.version, applied=applied, duplicate=False, sync=str(self.sync or ""),
                                loss_scale=self.loss_scale, ready_version=ready)
            due = applied and self._checkpoint_due() and policy.quiescent()
        if due:
            self.checkpoint_now()
        return result

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

    def pull(self, worker_id: int, names: list[str], wire_dtype: int | None, chunk_bytes: int, *,
             min_version: int, min_clock: int, epoch: int, timeout: float,
             segment: Segment | None = None) -> tuple[float, Sequence[Item] | Framing]:
        """A worker's Pull (decoded by server/wire.py): wait (up to ``timeout`` in all) for ``min_version``
        and, under ssp, for every worker's clock to reach ``min_clock``; then the weights of ``names`` (all
        when empty) as whole framed ``PullResponse`` messages (``read(messages=True)``), once the backup
        holds them. With ``segment`` (the same-host fast path) the weights go there instead and the messages
        only say where (``read_into``). Returns (seconds waited, messages): a list, or for a large Pull a ``Framing``
        being filled outside the lock (iterate it)."""
        self.check_epoch(epoch)
        self.touch(worker_id)
        names = names or self.names()
        for n in names:
            self.spec(n)  # NotFound before any wait
        t0 = time.monotonic()
        slowest = 0
        if min_version > self.version:
            self.wait_version(min_version, timeout, epoch)
        if min_clock > 0:
            slowest = self.wait_clock(min_clock, max(0.0, timeout - (time.monotonic() - t0)))
        waited = time.monotonic() - t0
        self.touch(worker_id)
        messages: Sequence[Item] | Framing
        if segment is not None:
            _, messages = self.read_into(names, wire_dtype, segment, slowest_clock=slowest, worker_id=worker_id)
        else:
            _, messages = self.read(names, wire_dtype, chunk_bytes, messages=True, slowest_clock=slowest,
                                    worker_id=worker_id)
        self.replicated()  # workers see only weights the backup holds too (--replicas 2)
        return waited, messages

    def weights_now(self, worker_id: int, ready_version: int, wire_dtype: int | None, min_clock: int, epoch: int,
                    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> list[bytes]:
        """A Push's ``pull_after``: what a Pull of every tensor of the shard (``min_version=ready_version``,
        ``min_clock``) would answer, if it can be answered at once and the weights are small (at most
        ``SMALL_PULL_BYTES`` in the wire dtype); else [] (the worker pulls). Never waits, never raises a
        failure of its own: the worker's Pull meets it instead."""
        with self._cond:
            small = payload_bytes(list(self._tensors.values()), wire_dtype) <= SMALL_PULL_BYTES
        if not small:
            return []
        try:
            _, messages = self.pull(worker_id, [], wire_dtype, chunk_bytes, min_version=ready_version,
                                    min_clock=min_clock, epoch=epoch, timeout=0.0)
        except StoreError:  # not ready yet (a barrier still open, a slow worker under ssp), or anything else
            return []
        return [msg for *_, msg in messages]

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
            self._await_reads()
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

    # -- what one RPC asks, in one call (server/service.py decodes and encodes around these) ------

    def heartbeat(self, worker_id: int) -> tuple[int, list[int], str]:
        """Renew ``worker_id``'s lease: (version, live workers, where the backup lives or "")."""
        self.check_serving()
        self._check_registered(worker_id)  # an evicted worker learns it here
        self.touch(worker_id)
        rep = self.replicator
        return self.version, sorted(self.live_workers()), rep.address if rep is not None and rep.state != "none" else ""

    def goodbye(self, worker_id: int) -> tuple[int, list[int]]:
        """``worker_id`` leaves the job (``leave``), once the backup knows: (version, live workers)."""
        self.check_serving()
        self.leave(worker_id)
        self.replicated()
        return self.version, sorted(self.live_workers())

    def recover(self, version: int, epoch: int) -> tuple[int, int]:
        """Roll back to the checkpoint at ``version`` in ``epoch`` (``rollback``), once the backup holds it."""
        self.check_serving()
        result = self.rollback(version, epoch)
        self.replicated()
        return result

    def switch_sync(self, sync: str) -> tuple[str, int]:
        """``set_sync``, once the backup holds it: (the sync mode now, version)."""
        self.check_serving()
        spec = self.set_sync(sync)
        self.replicated()
        return str(spec), self.version

    def checkpoint_request(self) -> tuple[int, str]:
        """Write a checkpoint now: (version, path)."""
        self.check_serving()
        path = self.checkpoint_now()
        return self.version, path

    def _remember_pulled(self, worker_id: int, names: list[str]) -> None:
        """dc-asgd: keep the weights ``worker_id`` pulled, to compensate its next gradient."""
        self._record(OpKind.PULLED, {"worker": worker_id, "names": names})
        self.applier.remember_pulled(self._tensors, worker_id, names)

    def close(self) -> None:
        """Shutting down: waits in progress end with UNAVAILABLE, new requests are refused."""
        self._reaper.signal_stop()
        with self._cond:
            self.closing = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.waiting == 0, timeout=5.0)  # parked waits have left

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
