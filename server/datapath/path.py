"""The data path of one shard: the requests that change the job, each a critical section over the store's parts.

``DataPath`` holds no state of its own: it is given the store's lock and
the parts (the tensors, the job, the leases, the applier, the reader, the
replica side as ``Recorder`` and for the waits on the backup, the
checkpointer's schedule) and runs, under the lock in the order
server/store.py documents, what a Register (``configure``, ``join``,
``register_tensors``), a Push (``submit``, ``step``), a Pull (``pull``,
``weights_now``) and a sync switch (``set_sync``) do to them. The
``ShardStore`` facade exposes these methods as its own.

A Push says the sync mode its step ran under and the job's sync switch it
came from, so a step that straddles a live switch counts under one mode on
every shard (``submit``; protos/shardps/v1/ps.proto, PushRequest.sync).

Over 400 lines: every request that changes a shard's job is one critical
section here, in the order server/store.py documents; split, the order
would be spread over files.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from shardps.protos import codec
from shardps.protos.dataconn import FRAME_SEGMENT
from shardps.protos.deadlines import Deadlines
from shardps.protos.results import PushResult, Registered
from shardps.protos.shm import Segment
from shardps.protos.slices import TensorSlice
from shardps.protos.syncspec import SyncSpec
from shardps.server.checkpoint import Checkpointer
from shardps.server.datapath.apply import Applier
from shardps.server.datapath.reader import Framing, Item, Lent, Reader, payload_bytes
from shardps.server.datapath.slicepull import check_slices, read_slices
from shardps.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, StoreError, Unavailable
from shardps.server.job import Job
from shardps.server.membership import Clock, Leases
from shardps.server.parked import Parked, Signal
from shardps.server.remedies import Remedy, RemedyKind
from shardps.server.replication.roles import OpKind, Role
from shardps.server.replication.snapshot import pack, part_keys
from shardps.server.replication.state import ReplicaSide
from shardps.server.scaling import LossScaler, scaling_config, unscale_and_check
from shardps.server.sync import Contribution, Grads, Received, Update, make_policy, materialize
from shardps.server.table import PartKey, TensorSpec, TensorTable, spec_to_json

log = logging.getLogger("shardps.server")

# A Push that asks for the weights too (PushRequest.pull_after) gets them from a shard holding at most this
# many bytes of them (in the wire dtype asked): a small model's step in one call.
SMALL_PULL_BYTES = 1 << 20


class DataPath:
    """Register, Push, Pull and sync switches over the store's parts; see the module docstring."""

    def __init__(self, shard_index: int, num_shards: int, cond: Signal, *, table: TensorTable,
                 job: Job, leases: Leases, applier: Applier, reader: Reader, replica: ReplicaSide,
                 checkpointer: Checkpointer, checkpoint: Callable[[], Callable[[], str | None]],
                 clock: Clock) -> None:
        self.shard_index, self.num_shards = shard_index, num_shards
        self._cond = cond
        self.parked = Parked(cond, halted=job.halted_since, count=job.count_waiting)
        self.table, self.job, self.leases, self.applier, self.reader = table, job, leases, applier, reader
        self.replica, self.checkpointer, self._checkpoint, self.clock = replica, checkpointer, checkpoint, clock

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
            ap, job = self.applier, self.job
            if job.sync is None:
                job.sync, self.leases.membership.num_workers = spec, num_workers
                job.policy = make_policy(spec, num_workers, ap.pool.recycle)
                ap.scaler, ap.scaling_configured = loss_scaling, scaling
                ap.remedy = rem
                self.replica.record(OpKind.CONFIGURE, {"num_workers": num_workers, "sync": str(spec),
                                                       "remedy": str(rem),
                                                       "scaling": list(scaling) if scaling else None})
            elif self.leases.membership.num_workers != num_workers:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs a job of num_workers={self.leases.membership.num_workers}; "
                    f"a worker registered with num_workers={num_workers}"
                )
            elif ap.remedy != rem:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs staleness remedy {ap.remedy}; a worker asked for {rem}"
                )
            elif ap.scaling_configured != scaling:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs loss scaling {ap.scaling_configured or 'off'} "
                    f"(init, growth, backoff, interval); a worker asked for {scaling or 'off'}"
                )
            return job.sync

    def join(self, worker_id: int, num_workers: int, sync: str, scaling: LossScaler | None, remedy: str,
             specs: list[TensorSpec], values: Grads | None, timeout: float) -> Registered:
        """A worker's Register (decoded by server/datapath/wire.py): the job's settings agreed (``configure``), its
        tensors created from ``values`` (worker 0's) or, with ``values=None``, waited for up to ``timeout``;
        its lease started. Answered once the backup holds it."""
        mode = self.configure(num_workers, sync, scaling, remedy)
        self.leases.membership.check_worker_id(worker_id)
        created: list[str] = []
        if values is not None:
            created = self.register_tensors(specs, values)
        else:
            self.wait_for_tensors([s.name for s in specs], timeout)
            self.register_tensors(specs, None)
        self.leases.register(worker_id)
        self.replica.replicated()
        log.info("shard %d: worker %d registered (%d tensors, %d created)",
                 self.shard_index, worker_id, len(specs), len(created))
        with self._cond:
            rep, job = self.replica.replicator, self.job
            return Registered(job.version, self.shard_index, self.num_shards, str(mode), created,
                              self.applier.loss_scale, job.worker_clocks.get(worker_id, -1) + 1, self.leases.lease_s,
                              job.epoch, rep.address if rep else "", job.sync_switches_total,
                              worker_id in self.leases.membership.skips,
                              job.version + (1 if job.policy is not None and job.policy.holds(worker_id) else 0))

    def register_tensors(self, specs: Sequence[TensorSpec], values: dict[PartKey, torch.Tensor] | None) -> list[str]:
        """Create the tensors not yet held, from ``values`` (fp32, one per part).

        Tensors already held must have an equal spec (FAILED_PRECONDITION
        otherwise) and keep their weights. With ``values=None`` nothing is
        created: tensors not yet held are an error (see wait_for_tensors).
        All-or-nothing. Returns the names created.
        """
        TensorTable.validate(specs, self.shard_index)
        with self._cond:
            self.applier.settle()
            rep = self.replica
            entries = self.table.new_entries(specs, values, replicated=rep.recording, sync=self.job.sync,
                                             remedy=self.applier.remedy)
            self.table.add(entries)
            self.applier.add_peers(entries)
            if entries:
                if rep.recording:
                    rep.record(OpKind.REGISTER_TENSORS, {"specs": [spec_to_json(e.spec) for e in entries]},
                               {f"{a}/{e.spec.name}": p.weight.clone() for e in entries for a, p in e.parts.items()})
                self._cond.notify_all()
            return [e.spec.name for e in entries]

    def wait_for_tensors(self, names: Iterable[str], timeout: float) -> None:
        """Block until every name is registered; DeadlineExceeded names the missing."""
        wanted = list(names)
        with self._cond:
            if not self._cond.wait_for(lambda: all(n in self.table for n in wanted), timeout):
                missing = [n for n in wanted if n not in self.table]
                raise DeadlineExceeded(
                    f"shard {self.shard_index}: waited {timeout:.1f}s for worker 0 to register "
                    f"{len(missing)} tensors (first: {missing[:3]})"
                )

    def live_changed(self, live: set[int]) -> None:
        """Under the lock (given to Leases): the live workers changed; a barrier waiting for a gone one may complete."""
        policy = self.job.policy
        if policy is not None:
            for update in policy.live_changed(live):
                self.step(update)

    def takes_chunked(self, loss_scale: float) -> bool:
        """Whether a Push with ``loss_scale`` is best handed to ``submit`` still in its chunks (``Chunked``).

        True when it would be stepped from them as they are: a policy that passes gradients through (asp),
        nothing to unscale, no backup to send them to. Otherwise ``submit`` copies them into fp32 buffers,
        which costs less while each chunk is still in cache, as it arrives. A hint: ``submit`` takes either.
        """
        policy = self.job.policy
        return not loss_scale and self.replica.replicator is None and policy is not None and policy.passes_through

    def submit(self, worker_id: int, step: int, base_version: int, grads: Received,
               nbytes: int = 0, *, found_inf: bool = False, loss_scale: float = 0.0,
               epoch: int | None = None, checked: bool = False,
               weights: Mapping[PartKey, int] | None = None, sync: str = "", sync_switch: int = 0) -> PushResult:
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
        cannot be, or a step the policy refuses. ``weights``: a sliced Push's (server/datapath/slicepush.py), how
        many gradients each part counts for (1 for those not named); refused unless the mode has a barrier.
        ``sync``, ``sync_switch``: the mode the worker ran the step under and the job's sync switch it came
        from (the Push's). From an earlier switch than this shard's last: its mode is over, the gradient is
        ``late`` (server/sync.py). From a later one: this shard makes that switch first (``set_sync``).
        """
        spec = self._said_sync(sync, sync_switch, worker_id, step)
        if not (loss_scale == 0.0 or (math.isfinite(loss_scale) and loss_scale > 0)):
            raise InvalidArgument(f"loss_scale must be a positive finite number or 0, got {loss_scale}")
        job, rep, take = self.job, self.replica, self.applier.pool.take
        with self._cond:
            job.check_epoch(epoch)
            m = self.leases.membership
            m.check_registered(worker_id)
            m.last_seen[worker_id] = self.clock()
            if step < 0:
                raise InvalidArgument(f"step must be >= 0, got {step}")
            if not 0 <= base_version <= job.version:
                raise InvalidArgument(
                    f"base_version {base_version} is outside [0, {job.version}] "
                    f"(shard {self.shard_index} is at version {job.version})"
                )
            for (name, start), g in grads.items():
                self.table.part(name, start, g.numel())
        # Gradients still in their chunks stay so only to be stepped from as they are (takes_chunked);
        # anything else gets fp32 buffers, outside the lock (a no-op for fp32 tensors).
        fp32 = None if checked and self.takes_chunked(loss_scale) else materialize(grads, take)
        if fp32 is not None:
            grads = fp32
            # Unscale and check outside the lock: the buffers are this request's own. ``checked``:
            # the caller already looked at every value (the Push assembly does, chunk by chunk).
            if loss_scale or not checked:
                found_inf = unscale_and_check(list(fp32.values()), loss_scale) or found_inf
        # The backup replays the gradient as taken in here (unscaled); packed (copied) before the sync
        # policy may sum other workers' gradients into these buffers.
        packed = pack(part_keys(fp32)) if rep.replicator and fp32 is not None else None
        with self._cond:
            self.applier.settle()
            self.reader.await_reads()  # before the policy takes the gradient: the step below changes weights in place
            job.check_epoch(epoch)
            policy = job.policy
            assert policy is not None  # registered workers imply a job
            # The worker learned of a switch from another shard first (made below, once the push is sure to
            # be taken in), or computed the gradient under a mode this shard has left (late: server/sync.py).
            adopt = spec if spec is not None and sync_switch > job.sync_switches_total else None
            late = sync_switch < job.sync_switches_total
            if weights is not None and not (adopt.barrier if adopt else not policy.passes_through):
                raise FailedPrecondition(
                    f"worker {worker_id} pushed slices of tensors under {adopt or job.sync_text}: slices are added "
                    f"up before a step, which needs a barrier sync mode (bsp or every:X)")
            last = job.worker_clocks.get(worker_id, -1)
            if step <= last:  # a retry of a push already taken in
                job.pushes_total += 1
                job.duplicate_pushes_total += 1
                ready = job.version + (1 if policy.holds(worker_id) else 0)
                return PushResult(job.version, applied=False, duplicate=True, sync=job.sync_text,
                                  loss_scale=self.applier.loss_scale, ready_version=ready,
                                  sync_switch=job.sync_switches_total)
            skip = step > last + 1 and worker_id in self.leases.membership.skips  # a rejoin's clock: the newest
            if step != last + 1 and not skip:
                raise FailedPrecondition(
                    f"worker {worker_id} pushed step {step}, but its last step on shard {self.shard_index} "
                    f"was {last}: steps go up by one"
                )
            contribution = Contribution(worker_id, step, base_version, found_inf, late)
            if adopt is None:  # refused here, before it is recorded: a backup never replays what was refused
                policy.check_offer(contribution)
            else:  # (a switch starts a policy that holds nothing)
                self._switch_locked(adopt, sync_switch)
                policy = job.policy
                assert policy is not None
            if not policy.passes_through:  # a barrier since takes_chunked (a switch): fp32 buffers after all
                grads = materialize(grads, take)
            if rep.replicator is not None:
                if packed is None:  # a backup was attached in between
                    grads = fp32 = materialize(grads, take)
                    packed = pack(part_keys(fp32))
                rep.record(OpKind.SUBMIT, {"worker": worker_id, "step": step, "base_version": base_version,
                                           "found_inf": found_inf, "nbytes": nbytes,
                                           "weights": [[n, a, w] for (n, a), w in (weights or {}).items()],
                                           "sync": sync, "sync_switch": sync_switch},
                           packed=packed)
            updates = policy.offer(contribution, grads, weights)
            job.pushes_total += 1
            job.push_bytes_total += nbytes
            job.worker_clocks[worker_id] = step
            self.leases.membership.skips.discard(worker_id)
            applied = False
            for update in updates:
                applied |= self.step(update)
            policy = job.policy
            assert policy is not None
            ready = job.version + (1 if policy.holds(worker_id) else 0)
            self._cond.notify_all()  # versions and clocks moved
            result = PushResult(job.version, applied=applied, duplicate=False, sync=job.sync_text,
                                loss_scale=self.applier.loss_scale, ready_version=ready,
                                sync_switch=job.sync_switches_total)
            due = (applied and rep.role is Role.PRIMARY and self.checkpointer.due(job.version)
                   and policy.quiescent())
            # The checkpoint's state is taken now, in this hold of the lock: taken once the lock is released,
            # a step landing in between would make it a later version's, on this shard only.
            write = self._checkpoint() if due else None
        if write is not None:
            write()
        return result

    def step(self, update: Update) -> bool:
        """Under the lock: one optimizer step (or a skipped one, False); the version advances either way."""
        self.applier.settle()
        self.reader.before_write()  # no Pull frames these weights outside the lock while they change
        applied = self.applier.step(update, self.job.version)
        self.job.version += 1
        return applied

    def pull(self, worker_id: int, names: list[str], wire_dtype: int | None, chunk_bytes: int, *,
             min_version: int, min_clock: int, epoch: int, timeout: float,
             segment: Segment | None = None) -> tuple[float, Sequence[Item] | Framing]:
        """A worker's Pull (decoded by server/datapath/wire.py): wait (up to ``timeout`` in all) for ``min_version``
        and, under ssp, for every worker's clock to reach ``min_clock``; then the weights of ``names`` (all
        when empty) as whole framed ``PullResponse`` messages (``read(messages=True)``), once the backup
        holds them. With ``segment`` (the same-host fast path) the weights go there instead and the messages
        only say where (``read_into``). Returns (seconds waited, messages): a list, or for a large Pull a ``Framing``
        being filled outside the lock (iterate it)."""
        if not names:
            with self._cond:
                names = sorted(self.table)
        waited, slowest = self._wait(worker_id, names, min_version, min_clock, epoch, timeout)
        messages: Sequence[Item] | Framing
        if segment is not None:
            _, messages = self.reader.read_into(names, wire_dtype, segment, slowest_clock=slowest,
                                                worker_id=worker_id)
        else:
            _, messages = self.reader.read(names, wire_dtype, chunk_bytes, messages=True, slowest_clock=slowest,
                                           worker_id=worker_id)
        self.replica.replicated()  # workers see only weights the backup holds too (--replicas 2)
        return waited, messages

    def parks(self) -> bool:
        """Whether a Pull may wait without a thread (``pull_soon``): not with a backup, whose holding the
        weights its answer would wait for."""
        return self.replica.replicator is None

    def pull_soon(self, worker_id: int, names: list[str], wire_dtype: int | None, *, min_version: int,
                  min_clock: int, epoch: int, timeout: float, segment: Segment, deadlines: Deadlines,
                  answer: Callable[[float, list[Item] | None, memoryview | Lent | None, BaseException | None], None]
                  ) -> None:
        """``pull`` for a data connection, without a thread that waits (server/parked.py): answered in this
        thread when the weights are there, else parked and answered by the thread whose change makes them
        so, or ``timeout`` from now with DEADLINE_EXCEEDED, as ``pull``'s wait would. The weights are
        framed once per version for every such Pull and sent from themselves (``Reader.read_lent``, where the
        segment ``lends``: the answer's payload a ``Lent``, closed here once ``answer`` returned) or from
        one copy (``Reader.read_shared``; ``segment``: the worker's pull buffer, whose size they must fit);
        a ``segment`` of shared memory (the same-host path) gets them
        written into it (``Reader.read_into``), the messages only saying where (no bytes to send).
        ``answer(seconds waited, messages, their bytes, None)`` or ``answer(seconds waited, None, None,
        error)``: called once, outside the lock (a failure before any wait is raised instead). Only where
        ``parks()``."""
        job = self.job
        t0 = time.monotonic()
        with self._cond:
            if not names:
                names = sorted(self.table)
            job.check_epoch(epoch)
            self.leases.membership.touch(worker_id)
            for n in names:
                self.table.spec(n)  # NotFound before any wait

            def ready() -> bool:
                return job.version >= min_version and (min_clock <= 0 or job.slowest_clock() >= min_clock)

            def finish(timed_out: bool) -> None:
                try:
                    with self._cond:
                        if timed_out:
                            raise job.wait_failure(min_version, min_clock, timeout)
                        job.check_halted()
                        job.check_epoch(epoch)
                        slowest = job.slowest_clock() if min_clock > 0 else 0
                        self.leases.membership.touch(worker_id)
                        if self.replica.replicator is not None:
                            # A backup attached since the Pull parked (a rare moment): its answer would wait for
                            # the backup, which this thread (whichever released the lock) must not do. The
                            # worker asks again; that Pull takes a thread of its own (``parks``).
                            raise Unavailable(f"shard {self.shard_index}: a backup was attached while this Pull "
                                              f"waited: ask again")
                    waited = time.monotonic() - t0
                    payload: memoryview | Lent | None = None
                    if segment.name != FRAME_SEGMENT:  # the worker's own shared-memory segment
                        _, messages = self.reader.read_into(names, wire_dtype, segment, slowest_clock=slowest,
                                                            worker_id=worker_id)
                    elif getattr(segment, "lends", False):
                        # Sent from the weights themselves where their dtype is the wire's (one framing a version
                        # for every worker's Pull; a rest the socket did not take copied before the next step).
                        _, messages, payload = self.reader.read_lent(names, wire_dtype, segment.size,
                                                                     slowest_clock=slowest, worker_id=worker_id)
                    else:
                        # One copy and one framing of this version's weights for every worker's Pull (bsp: each
                        # worker of the round), not one each: the answers send the same buffer.
                        _, messages, payload = self.reader.read_shared(names, wire_dtype, segment.size,
                                                                       slowest_clock=slowest, worker_id=worker_id)
                except Exception as e:  # noqa: BLE001 - the Pull's answer
                    answer(time.monotonic() - t0, None, None, e)
                    return
                try:
                    answer(waited, messages, payload, None)
                finally:
                    if isinstance(payload, Lent):
                        payload.close()  # sent (or queued, lent until the next step) once ``answer`` returned

            if not ready():
                job.check_halted()  # a shard stopping or taken over parks nothing (as ``Job._park`` ends at once)
                self.parked.park(ready, finish, t0 + timeout, job.epoch, deadlines)
                return
        finish(False)

    def _wait(self, worker_id: int, names: Sequence[str], min_version: int, min_clock: int, epoch: int,
              timeout: float) -> tuple[float, int]:
        """A Pull's waits (NotFound for a name not held, before any): (seconds waited, slowest clock)."""
        job = self.job
        job.check_epoch(epoch)
        self.leases.touch(worker_id)
        for n in names:
            self.table.spec(n)  # NotFound before any wait
        t0 = time.monotonic()
        slowest = 0
        if min_version > job.version:
            job.wait_version(min_version, timeout, epoch)
        if min_clock > 0:
            slowest = job.wait_clock(min_clock, max(0.0, timeout - (time.monotonic() - t0)))
        self.leases.touch(worker_id)
        return time.monotonic() - t0, slowest

    def pull_slices(self, worker_id: int, names: list[str], slices: Mapping[str, TensorSlice],
                    wire_dtype: int | None, chunk_bytes: int, *, min_version: int, min_clock: int, epoch: int,
                    timeout: float, segment: Segment | None = None) -> tuple[float, list[bytes]]:
        """A Pull naming slices (server/datapath/slicepull.py): as ``pull`` (``names`` whole, none when empty), each
        tensor of ``slices`` as that slice only, its bytes in ``segment`` when one is named; INVALID_ARGUMENT
        for a slice that does not fit its tensor, before any wait."""
        with self._cond:
            check_slices(self.table, names, slices)
        waited, slowest = self._wait(worker_id, [*names, *slices], min_version, min_clock, epoch, timeout)
        messages = read_slices(self.reader, self.table, names, slices, wire_dtype, chunk_bytes, slowest_clock=slowest,
                               worker_id=worker_id, segment=segment)
        self.replica.replicated()
        return waited, messages

    def weights_now(self, worker_id: int, ready_version: int, wire_dtype: int | None, min_clock: int, epoch: int,
                    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> list[bytes]:
        """A Push's ``pull_after``: what a Pull of every tensor of the shard (``min_version=ready_version``,
        ``min_clock``) would answer, if it can be answered at once and the weights are small (at most
        ``SMALL_PULL_BYTES`` in the wire dtype); else [] (the worker pulls). Never waits, never raises a
        failure of its own: the worker's Pull meets it instead."""
        with self._cond:
            small = payload_bytes(list(self.table.values()), wire_dtype) <= SMALL_PULL_BYTES
        if not small:
            return []
        try:
            _, messages = self.pull(worker_id, [], wire_dtype, chunk_bytes, min_version=ready_version,
                                    min_clock=min_clock, epoch=epoch, timeout=0.0)
        except StoreError:  # not ready yet (a barrier still open, a slow worker under ssp), or anything else
            return []
        return [msg for *_, msg in messages]

    def on_read(self, worker_id: int | None, names: list[str]) -> None:
        """Under the lock (given to the Reader): dc-asgd keeps the weights a registered worker reads."""
        if (self.applier.remedy.kind is RemedyKind.DC_ASGD and worker_id is not None
                and worker_id in self.leases.membership.workers):
            self.remember_locked(worker_id, names)

    def remember_locked(self, worker_id: int, names: list[str]) -> None:
        """dc-asgd: keep the weights ``worker_id`` pulled, to compensate its next gradient."""
        self.replica.record(OpKind.PULLED, {"worker": worker_id, "names": names})
        self.applier.remember_pulled(self.table, worker_id, names)

    def set_sync(self, sync: str, switch: int | None = None) -> SyncSpec:
        """Switch the running job's sync mode. Held gradients are applied first, none is lost.

        ``switch``: the job's switch this is (a backup replaying its primary's); None: the next one, unless
        the job already runs ``sync`` (then nothing changes)."""
        try:
            spec = SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        with self._cond:
            self.applier.settle()
            self._switch_locked(spec, switch)
        return spec

    def _said_sync(self, sync: str, switch: int, worker_id: int, step: int) -> SyncSpec | None:
        """A Push's ``sync`` and ``sync_switch``, checked (outside the lock: they change nothing yet)."""
        if switch < 0:
            raise InvalidArgument(f"worker {worker_id}, step {step}: sync_switch must be >= 0, got {switch}")
        if not sync:
            if switch:
                raise InvalidArgument(f"worker {worker_id}, step {step}: a Push from sync switch {switch} must "
                                      f"name its sync mode, got ''")
            return None
        try:
            return SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(f"worker {worker_id}, step {step}: {e}") from None

    def _switch_locked(self, spec: SyncSpec, switch: int | None) -> None:
        """Under the lock: make the job's sync switch number ``switch`` (None: the next) to ``spec``."""
        job = self.job
        if job.sync is None or self.leases.membership.num_workers is None or job.policy is None:
            raise FailedPrecondition(f"shard {self.shard_index} has no job yet: nothing to switch")
        if switch is None:
            if spec == job.sync:
                return
            switch = job.sync_switches_total + 1
        if switch <= job.sync_switches_total:
            return  # had already: a SetSync after a worker's Push brought the switch here
        if spec != job.sync and not spec.barrier and self.table.has_split():
            raise FailedPrecondition(
                f"shard {self.shard_index} holds tensors split with cross-shard statistics, which "
                f"need bsp or every:X; cannot switch to {spec}"
            )
        self.reader.await_reads()
        self.replica.record(OpKind.SET_SYNC, {"sync": str(spec), "switch": switch})
        old = job.sync
        if spec != old:
            for update in job.policy.flush():
                self.step(update)
            num_workers = self.leases.membership.num_workers
            assert num_workers is not None  # checked above
            job.sync, job.policy = spec, make_policy(spec, num_workers, self.applier.pool.recycle)
            job.policy.track_live(self.leases.live())
        job.sync_switches_total = switch
        self._cond.notify_all()
        log.info("shard %d: sync %s -> %s (switch %d)", self.shard_index, old, spec, switch)

