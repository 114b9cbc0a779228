"""Replication's state machine (``ReplicaSide``, ``--replicas 2``): a shard's role, ops recorded on a primary and
replayed on a backup, the takeover.

``ReplicaSide`` is the store's part that keeps or serves a copy. It owns
the shard's ``Role`` (server/replication/roles.py, with the other enums and their
transition tables), the replicator and the link that opens it, and the
backup's bookkeeping (the last op replayed, whose copy it holds, the
promotions). On a primary it is the ``Recorder`` the other parts record
their changes into, and attaches a backup through the injected
``ReplicaLink`` (the gRPC sender is server/replication/transport.py); on a backup it
replays the primary's ops in order (``apply_ops``) through the ``Replayer``
it is given (the store: the same code path as the requests themselves) and
takes over (``promote``). It takes the store's lock and the replay lock as
the lock order in server/store.py says; no network call is made holding
either.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardps.server.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    StoreError,
    Unavailable,
)
from shardps.server.replication.peers import ReplicaLink, ReplicaSink
from shardps.server.replication.roles import Fence, FenceError, OpKind, ReplicaState, Role, RoleEvent, next_role
from shardps.server.replication.snapshot import Packed, parse_part_keys
from shardps.server.scaling import LossScaler
from shardps.server.table import PartKey, TensorSpec, spec_from_json

__all__ = ["DEFAULT_REPLICA_TIMEOUT_S", "Deposed", "Op", "ReplicaSide", "Replayer"]

log = logging.getLogger("shardps.server")

DEFAULT_REPLICA_TIMEOUT_S = 30.0

Snapshot = tuple[int, dict[str, Any], dict[str, torch.Tensor]]  # (version, meta, tensors): snapshot.py


@dataclass
class Op:
    seq: int
    kind: str  # an OpKind; as received (any string) on the backup until replayed
    args: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    packed: Packed | None = None  # the tensors already packed (a copy the store made under its lock)


class Deposed(Exception):
    """The backup took over this shard: the primary must not acknowledge anything more."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.address = address


class Replayer(Protocol):
    """What the replica side is given to replay ops and take over with (the store implements it).

    The methods take the store's lock themselves, but for ``*_locked``,
    called with it held.
    """

    @property
    def version(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    def snapshot_locked(self, *, holds: bool = False) -> Snapshot: ...

    def split_names_locked(self) -> list[str]: ...

    def renew_leases_locked(self) -> None: ...

    def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...

    def configure(self, num_workers: int, sync: str, loss_scaling: LossScaler | None = None,
                  remedy: str | None = None) -> Any: ...

    def register_worker(self, worker_id: int) -> None: ...

    def register_tensors(self, specs: Sequence[TensorSpec],
                         values: dict[PartKey, torch.Tensor] | None) -> list[str]: ...

    def submit(self, worker_id: int, step: int, base_version: int, grads: Any, nbytes: int = 0, *,
               found_inf: bool = False, checked: bool = False, weights: Any = None, sync: str = "",
               sync_switch: int = 0) -> Any: ...

    def leave(self, worker_id: int) -> bool: ...

    def set_sync(self, sync: str, switch: int | None = None) -> Any: ...

    def evict(self, workers: list[int]) -> None: ...

    def remember_pulled(self, worker_id: int, names: list[str]) -> None: ...

    def replay_rows(self, args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...


class ReplicaSide:
    """The replica side of one shard, and its ``Recorder``; see the module docstring."""

    def __init__(self, shard_index: int, num_shards: int, cond: threading.Condition, replayer: Replayer, *,
                 role: Role = Role.PRIMARY, replica_link: ReplicaLink | None = None,
                 timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S) -> None:
        self.shard_index, self.num_shards = shard_index, num_shards
        self._cond = cond
        self._replay_lock = threading.Lock()  # backup: one replicated op replayed, or a promotion, at a time
        self._takeover_lock = threading.Lock()  # with a coordinator: one takeover (its etcd calls) at a time
        self._replayer = replayer
        self.role = role
        self.address = ""  # this shard's own address, once served
        self.replicator: ReplicaSink | None = None  # a primary with a backup records every change here
        self.replica_link = replica_link  # opens the backup's sink; given at start-up
        self.replica_timeout_s = timeout_s
        self.moved_to = ""  # deposed: the backup that took over
        self.primary_address = ""  # backup role: the primary it copies
        self.replica_seq = 0  # backup role: the last op applied
        self.replica_synced = False
        self.replica_incarnation = ""  # backup role: the run of the primary whose copy it holds
        self.promotions_total = 0
        self.fence: Fence | None = None  # --coordinator: who serves the shard is the coordinator's to say
        self.fence_epoch_seen = 0  # backup role: the newest fencing epoch of the ops it replayed

    # -- the primary's side ---------------------------------------------------

    @property
    def recording(self) -> bool:
        """Whether a backup is attached: changes are recorded for it."""
        return self.replicator is not None

    def record(self, kind: OpKind, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
               packed: Any = None) -> None:
        """Under the lock: a change of state the backup must replay (nothing without a backup)."""
        if self.replicator is not None:
            self.replicator.record(kind, args, tensors, packed)

    def record_snapshot(self) -> None:
        """Under the lock: the whole state, for a backup (after a rollback, or to sync a new one)."""
        if self.replicator is not None:
            version, meta, tensors = self._replayer.snapshot_locked(holds=True)
            self.replicator.record(OpKind.SNAPSHOT, {"version": version, "meta": meta}, tensors)

    def _replica_snapshot(self) -> None:
        with self._cond:
            assert self.replicator is not None
            self.replicator.begin_sync()
            self.record_snapshot()

    def attach_replica(self, address: str, timeout: float = 0.0) -> str:
        """Keep a backup of this shard at ``address`` from now on; the replica state after ``timeout``."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 255:
            raise InvalidArgument(f"AttachReplica: expected HOST:PORT, got {address[:300]!r}")
        if address == self.address:
            raise InvalidArgument(f"AttachReplica: {address} is shard {self.shard_index}'s own address")
        with self._cond:
            if self.role != Role.STARTING:
                self.check_serving()
            split = self._replayer.split_names_locked()
            if split:
                raise FailedPrecondition(f"shard {self.shard_index} holds tensors split with cross-shard statistics "
                                         f"({split[:3]}), which cannot be replicated; keep them whole")
            if self.replicator is None:
                if self.replica_link is None:
                    raise FailedPrecondition(f"shard {self.shard_index} has no connection to other servers: "
                                             f"it is not served")
                self.replicator = self.replica_link.sink(self.shard_index, self.num_shards,
                                                         timeout_s=self.replica_timeout_s,
                                                         primary_address=self.address)
                self.replicator.on_deposed = self._deposed
                self.replicator.fence_epoch = lambda: self.fence.epoch if self.fence is not None else 0
            rep = self.replicator
        try:
            rep.attach(address, self._replica_snapshot)  # outside the lock: it may start the sender
        except Deposed as e:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {e.address}") from None
        log.info("shard %d: replicating to %s", self.shard_index, address)
        return str(rep.wait_synced(timeout) if timeout > 0 else rep.state)

    def _deposed(self, address: str) -> None:
        with self._cond:
            self.role = next_role(self.role, RoleEvent.DEPOSED)
            self.moved_to = address
            self._cond.notify_all()

    def replicated(self, timeout: float | None = None) -> None:
        """Block until every change made so far is on the backup (at once without one); with a coordinator,
        then check that this server still holds the shard: what it acknowledges after this is fenced.

        A primary whose backup is lost (degraded) goes on alone only once the coordinator records it
        (``Fence.go_alone``): otherwise the backup could take over with a copy that lacks what this one
        acknowledged. UNAVAILABLE, naming why, when either check fails: the change is not acknowledged
        (applied here, it is an outcome the worker does not know, as a timeout's)."""
        rep = self.replicator
        if rep is not None:
            try:
                rep.wait(None, 2 * self.replica_timeout_s if timeout is None else timeout)
            except Deposed as e:
                self._deposed(e.address)
                raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {e.address}") from None
            except TimeoutError as e:
                raise Unavailable(str(e)) from None
        fence = self.fence
        if fence is None or self.role != Role.PRIMARY:
            return
        if rep is not None and rep.state == ReplicaState.DEGRADED and not fence.alone and not fence.go_alone():
            raise Unavailable(f"shard {self.shard_index} lost its backup at {rep.address} and the coordinator did "
                              f"not record that it goes on alone: not acknowledging")
        if rep is not None and rep.state == ReplicaState.SYNCED and fence.wants_together():
            fence.back_together()  # the backup holds every change again: it may take over once more
        why = fence.why_not()
        if why:
            raise Unavailable(f"{why}: not acknowledging")

    def check_serving(self) -> None:
        """UNAVAILABLE unless this store serves its shard: not a backup, not a deposed primary."""
        if self.role == Role.BACKUP:
            raise Unavailable(f"this is a backup of shard {self.shard_index} (its primary: "
                              f"{self.primary_address or 'not known yet'}); it serves only after a Promote")
        if self.role == Role.DEPOSED:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {self.moved_to}")
        if self.role == Role.STARTING:
            raise Unavailable(f"shard {self.shard_index} is starting: it checks whether its backup took over "
                              f"while it was down")
        fence = self.fence
        if fence is not None and self.role == Role.PRIMARY:
            why = fence.why_not()
            if why:
                raise Unavailable(why)

    def check_fence(self, epoch: int, what: str) -> None:
        """A request (``what``) that carries the shard's fencing epoch ``epoch`` (0: it carries none): refused,
        changing nothing, when it is not this primary's: an older one FAILED_PRECONDITION (its sender has not
        learnt of a takeover), a newer one UNAVAILABLE (this server was taken over: the sender goes on to the
        new primary). Both epochs are named."""
        fence = self.fence
        if fence is None or not epoch:
            return
        mine = fence.epoch
        if epoch < mine:
            raise FailedPrecondition(f"shard {self.shard_index}: {what} of fencing epoch {epoch}, older than this "
                                     f"primary's {mine}: it was sent to a primary that was taken over; nothing "
                                     f"applied")
        if epoch > mine:
            raise Unavailable(f"shard {self.shard_index}: {what} of fencing epoch {epoch}, newer than this server's "
                              f"{mine}: another server took the shard over; nothing applied")

    def start_replicated(self, target: str, timeout: float) -> str:
        """Start as the primary only if the backup at ``target`` has not taken the shard over meanwhile.

        Until the first attempt to sync the backup settles (in sync, backup
        unreachable, or it answers that it was promoted: deposed), data
        RPCs answer UNAVAILABLE. A server restarted after a takeover thus
        never serves a stale copy of its shard.
        """
        with self._cond:
            self.role = next_role(self.role, RoleEvent.START)
        self.attach_replica(target)
        assert self.replicator is not None
        state: str = self.replicator.wait_synced(
            timeout, settled=(ReplicaState.SYNCED, ReplicaState.DEGRADED, ReplicaState.DEPOSED))
        with self._cond:
            self.role = next_role(self.role, RoleEvent.SETTLED)
            self._cond.notify_all()
        if self.role == Role.DEPOSED:
            log.error("shard %d: its backup at %s took it over while this server was down; this server does "
                      "not serve it (workers are sent there)", self.shard_index, target)
        return str(state)

    def stop_replication(self) -> None:
        if self.replicator is not None:
            self.replicator.close()

    # -- the backup's side ----------------------------------------------------

    def apply_ops(self, ops: Iterable[tuple[Any, Op]]) -> tuple[int, int]:
        """Backup side: replay the primary's ops in order; (last op applied, version).

        FAILED_PRECONDITION once promoted (the sender is deposed); ABORTED
        when the whole state is needed first (a gap, never synced, a replay
        that failed).
        """
        if self.role == Role.PRIMARY and not self.promotions_total:  # a misdirected --replica-target
            raise InvalidArgument(f"this endpoint serves shard {self.shard_index} as its primary: it holds no backup")
        for head, op in ops:
            with self._replay_lock:
                if self.role != Role.BACKUP:
                    raise FailedPrecondition(f"the backup of shard {self.shard_index} here was promoted and serves "
                                             f"the shard now: the old primary must stop")
                if (head.shard_index, head.num_shards) != (self.shard_index, self.num_shards):
                    raise InvalidArgument(f"this endpoint backs shard {self.shard_index} of {self.num_shards}, "
                                          f"got changes of shard {head.shard_index} of {head.num_shards}")
                if head.fence_epoch and head.fence_epoch < self.fence_epoch_seen:
                    raise FailedPrecondition(
                        f"the backup of shard {self.shard_index} here has seen fencing epoch {self.fence_epoch_seen}; "
                        f"op {op.seq} is of epoch {head.fence_epoch}: its sender is no longer the primary")
                if self.replica_incarnation and head.incarnation != self.replica_incarnation:
                    raise FailedPrecondition(
                        f"the backup of shard {self.shard_index} here holds the state of an earlier run of its "
                        f"primary (op {self.replica_seq}, version {self._replayer.version}): a restarted primary "
                        f"must not overwrite acknowledged updates; this backup takes the shard over instead")
                if op.kind != OpKind.SNAPSHOT and (not self.replica_synced or op.seq != self.replica_seq + 1):
                    why = "it never got the whole state" if not self.replica_synced else \
                        f"op {op.seq} came after op {self.replica_seq}"
                    self.replica_synced = False
                    raise Aborted(f"backup of shard {self.shard_index}: {why}: send the whole state")
                try:
                    self._replay(op)
                except StoreError as e:
                    self.replica_synced = False
                    raise Aborted(f"backup of shard {self.shard_index} could not replay op {op.seq} ({op.kind}): "
                                  f"{e}; send the whole state") from None
                self.replica_seq = op.seq
                self.primary_address = head.primary or self.primary_address
                self.replica_incarnation = head.incarnation
                self.fence_epoch_seen = max(self.fence_epoch_seen, head.fence_epoch)
        return self.replica_seq, self._replayer.version

    def _replay(self, op: Op) -> None:
        a, t, r = op.args, op.tensors, self._replayer
        try:
            kind = OpKind(op.kind)
        except ValueError:
            raise InvalidArgument(f"unknown replication op {op.kind!r}") from None
        if kind == OpKind.SNAPSHOT:
            r.restore(a["version"], a["meta"], t)
            self.replica_synced = True
        elif kind == OpKind.CONFIGURE:
            sc = a["scaling"]
            r.configure(a["num_workers"], a["sync"], LossScaler(*sc) if sc else None, a["remedy"])
        elif kind == OpKind.REGISTER_WORKER:
            r.register_worker(a["worker"])
        elif kind == OpKind.REGISTER_TENSORS:
            r.register_tensors([spec_from_json(d) for d in a["specs"]], parse_part_keys(t))
        elif kind == OpKind.SUBMIT:
            r.submit(a["worker"], a["step"], a["base_version"], parse_part_keys(t), a["nbytes"],
                     found_inf=a["found_inf"], checked=True,
                     weights={(n, s): w for n, s, w in a["weights"]} if a.get("weights") else None,
                     sync=a.get("sync", ""), sync_switch=a.get("sync_switch", 0))
        elif kind == OpKind.LEAVE:
            r.leave(a["worker"])
        elif kind == OpKind.EVICT:
            r.evict(list(a["workers"]))
        elif kind == OpKind.SET_SYNC:
            r.set_sync(a["sync"], a.get("switch"))
        elif kind == OpKind.PULLED:
            r.remember_pulled(a["worker"], list(a["names"]))
        elif kind == OpKind.ROWS:
            r.replay_rows(a, t)

    def take_over(self, reason: str = "") -> tuple[int, int, int]:
        """A worker's fail-over: ``promote`` without force (refused while the primary serves)."""
        return self.promote(reason, force=False)

    def promote(self, reason: str = "", force: bool = False) -> tuple[int, int, int]:
        """Backup side: serve the shard from now on (idempotent): (shard index, version, epoch).

        Refused while the primary still answers its health check with
        SERVING (unless ``force``): a worker that cannot reach a live
        primary must not split the shard in two. That check is a call to
        another server: made with no lock held, then the role is checked
        again under the replay lock.
        """
        self._promote(reason, force)
        return self.shard_index, self._replayer.version, self._replayer.epoch

    def _promote(self, reason: str, force: bool) -> None:
        if self.fence is None:
            self._promote_now(reason, force)
            return
        with self._takeover_lock:  # concurrent takeovers (every worker fails over at once): one asks etcd at a time
            self._promote_now(reason, force)

    def _promote_now(self, reason: str, force: bool) -> None:
        primary = None
        if self.fence is not None:  # the coordinator decides, --force or not: no health check can
            with self._replay_lock:
                if not self._may_promote():
                    return
                primary = self.primary_address
            try:
                self.fence.take_over(primary)
            except FenceError as e:
                with self._replay_lock:
                    if not self._may_promote():
                        return
                raise FailedPrecondition(str(e)) from None
        elif not force:
            with self._replay_lock:
                if not self._may_promote():
                    return
                primary = self.primary_address
            link = self.replica_link
            if link is not None and link.primary_serving(primary):
                with self._replay_lock:
                    if not self._may_promote():
                        return
                raise FailedPrecondition(
                    f"the primary of shard {self.shard_index} at {primary} still answers SERVING: "
                    f"not taking over (`shardps ctl promote --force` overrides)")
        with self._replay_lock:
            if not self._may_promote():
                return
            if primary is not None and self.primary_address != primary:  # a newer primary replicated meanwhile
                raise FailedPrecondition(
                    f"the backup of shard {self.shard_index} here now copies the primary at "
                    f"{self.primary_address}, not {primary}: ask again")
            with self._cond:
                self.role = next_role(self.role, RoleEvent.PROMOTE)
                self._replayer.renew_leases_locked()  # a fresh lease at the new address
                self.promotions_total += 1
                self._cond.notify_all()
        log.warning("shard %d: the backup at %s took over from %s at version %d (op %d): %s", self.shard_index,
                    self.address, self.primary_address, self._replayer.version, self.replica_seq,
                    reason or "no reason given")

    def _may_promote(self) -> bool:
        """Under the replay lock: False when already primary; raises when this store cannot take over."""
        if self.role == Role.PRIMARY:
            return False
        if self.role != Role.BACKUP:
            raise FailedPrecondition(f"shard {self.shard_index} here is {self.role}: it cannot take over")
        if not self.replica_synced:
            raise FailedPrecondition(f"this endpoint holds no copy of shard {self.shard_index} yet: "
                                     f"nothing to take over with")
        return True
