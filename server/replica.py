"""The replica side of a shard (``--replicas 2``): roles, replication ops, and the backup's replay.

Types instead of strings, str-valued where they go on the wire or into
stats (the formats are unchanged): ``Role`` of a store, ``ReplicaState`` of
the primary's replicator, ``OpKind`` of a replication op. Their allowed
transitions are the tables ``ROLE_TRANSITIONS`` and ``REPLICA_TRANSITIONS``
(tested in tests/server/test_replica.py); anything else raises
``InvalidTransition``.

``ReplicaMixin`` is the part of ``ShardStore`` that keeps or serves a copy:
on a primary, recording ops and attaching a backup (through the injected
``ReplicaLink``; the gRPC sender is server/replication.py); on a backup,
replaying the primary's ops in order (``apply_replica``) and taking over
(``promote``). Its methods use the store's lock and replay lock as the lock
order in server/store.py says; no network call is made holding either.

(Over 400 lines: the three enums' transition tables and the replica side
of the store belong to one concept, the replicated role of a shard, and are
read together.)
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardps.server.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    StoreError,
    Unavailable,
)
from shardps.server.scaling import LossScaler
from shardps.server.snapshot import Packed, parse_part_keys
from shardps.server.table import TensorEntry, spec_from_json, spec_to_json

if TYPE_CHECKING:
    from shardps.server.peers import ReplicaLink, ReplicaSink

log = logging.getLogger("shardps.server")

DEFAULT_REPLICA_TIMEOUT_S = 30.0


class StrEnum(str, enum.Enum):
    """A str-valued enum that prints, formats and serializes as its value."""

    def __str__(self) -> str:
        return str(self.value)


class InvalidTransition(ValueError):
    pass


class Role(StrEnum):
    PRIMARY = "primary"
    BACKUP = "backup"
    STARTING = "starting"  # a restarted primary, until it knows its backup did not take over
    DEPOSED = "deposed"  # its backup took over: it serves nothing more


class RoleEvent(StrEnum):
    START = "start"  # start_replicated: check the backup first
    SETTLED = "settled"  # the first sync with the backup settled
    PROMOTE = "promote"
    DEPOSED = "deposed"  # the backup answered that it was promoted


ROLE_TRANSITIONS: dict[tuple[Role, RoleEvent], Role] = {
    (Role.PRIMARY, RoleEvent.START): Role.STARTING,
    (Role.STARTING, RoleEvent.SETTLED): Role.PRIMARY,
    (Role.DEPOSED, RoleEvent.SETTLED): Role.DEPOSED,
    (Role.PRIMARY, RoleEvent.DEPOSED): Role.DEPOSED,
    (Role.STARTING, RoleEvent.DEPOSED): Role.DEPOSED,
    (Role.DEPOSED, RoleEvent.DEPOSED): Role.DEPOSED,
    (Role.BACKUP, RoleEvent.PROMOTE): Role.PRIMARY,
    (Role.PRIMARY, RoleEvent.PROMOTE): Role.PRIMARY,
}


def _transition(table: dict[tuple[Any, Any], Any], what: str, state: Any, event: Any) -> Any:
    try:
        return table[(state, event)]
    except KeyError:
        raise InvalidTransition(f"{what} {state}: no transition on {event}") from None


def next_role(role: Role, event: RoleEvent) -> Role:
    new: Role = _transition(ROLE_TRANSITIONS, "role", role, event)
    return new


class ReplicaState(StrEnum):
    """The primary's replica (see the diagram in server/replication.py)."""

    NONE = "none"
    RESYNC = "resync"
    SYNCING = "syncing"
    SYNCED = "synced"
    DEGRADED = "degraded"
    DEPOSED = "deposed"


class ReplicaEvent(StrEnum):
    ATTACH = "attach"  # a backup address given: the whole state goes first
    BEGIN_SYNC = "begin_sync"  # the snapshot op is recorded
    CONFIRMED = "confirmed"  # the backup confirmed a batch holding the snapshot
    FAILED = "failed"  # the backup is unreachable or failed: go on alone
    ABORTED = "aborted"  # the backup asks for the whole state again
    PROMOTED = "promoted"  # the backup answers that it took over


def _replica_table() -> dict[tuple[ReplicaState, ReplicaEvent], ReplicaState]:
    s, e = ReplicaState, ReplicaEvent
    t = {}
    for st in (s.RESYNC, s.SYNCING, s.SYNCED, s.DEGRADED):
        t[(st, e.ATTACH)] = s.RESYNC
        t[(st, e.BEGIN_SYNC)] = s.SYNCING
        t[(st, e.CONFIRMED)] = s.SYNCED if st == s.SYNCING else st
        t[(st, e.FAILED)] = s.DEGRADED
        t[(st, e.ABORTED)] = s.RESYNC
        t[(st, e.PROMOTED)] = s.DEPOSED
    t[(s.NONE, e.ATTACH)] = s.RESYNC
    for ev in (e.BEGIN_SYNC, e.CONFIRMED, e.FAILED, e.ABORTED, e.PROMOTED):
        t[(s.DEPOSED, ev)] = s.DEPOSED  # fenced for good: nothing brings it back
    return t


REPLICA_TRANSITIONS = _replica_table()


def next_replica_state(state: ReplicaState, event: ReplicaEvent) -> ReplicaState:
    new: ReplicaState = _transition(REPLICA_TRANSITIONS, "replica state", state, event)
    return new


class OpKind(StrEnum):
    """What a replication op records (the ``op`` field of ReplicateRequest)."""

    SNAPSHOT = "snapshot"
    CONFIGURE = "configure"
    REGISTER_WORKER = "register_worker"
    REGISTER_TENSORS = "register_tensors"
    SUBMIT = "submit"
    LEAVE = "leave"
    EVICT = "evict"
    SET_SYNC = "set_sync"
    PULLED = "pulled"


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


class ReplicaMixin:
    """The replica side of ``ShardStore`` (it supplies the attributes annotated here)."""

    shard_index: int
    num_shards: int
    address: str
    version: int
    epoch: int
    role: Role
    moved_to: str
    replicator: ReplicaSink | None
    replica_link: ReplicaLink | None
    replica_timeout_s: float
    primary_address: str
    replica_seq: int
    replica_synced: bool
    replica_incarnation: str
    promotions_total: int
    _cond: threading.Condition
    _replay_lock: threading.Lock

    if TYPE_CHECKING:  # the store's own methods
        def _snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]: ...
        def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...
        def configure(self, num_workers: int, sync: str, loss_scaling: LossScaler | None = None,
                      remedy: str | None = None) -> Any: ...
        def register_worker(self, worker_id: int) -> None: ...
        def register_tensors(self, specs: Any, values: Any) -> list[str]: ...
        def submit(self, *args: Any, **kwargs: Any) -> Any: ...
        def leave(self, worker_id: int) -> bool: ...
        def set_sync(self, sync: str) -> Any: ...
        def _evict(self, expired: list[int], now: float | None = None) -> None: ...
        def _remember_pulled(self, worker_id: int, names: list[str]) -> None: ...
        def _renew_leases(self) -> None: ...

    # -- the primary's side ---------------------------------------------------

    def _record(self, kind: OpKind, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Under the lock: a change of state the backup must replay (nothing without a backup)."""
        if self.replicator is not None:
            self.replicator.record(kind, args, tensors)

    def _record_registered(self, entries: list[TensorEntry]) -> None:
        if self.replicator is not None:
            self._record(OpKind.REGISTER_TENSORS, {"specs": [spec_to_json(e.spec) for e in entries]},
                         {f"{a}/{e.spec.name}": p.weight.clone() for e in entries for a, p in e.parts.items()})

    def _record_snapshot(self) -> None:
        if self.replicator is not None:
            version, meta, tensors = self._snapshot()
            self.replicator.record(OpKind.SNAPSHOT, {"version": version, "meta": meta}, tensors)

    def _replica_snapshot(self) -> None:
        with self._cond:
            assert self.replicator is not None
            self.replicator.begin_sync()
            self._record_snapshot()

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
            split = self._split_names()
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
            rep = self.replicator
        try:
            rep.attach(address, self._replica_snapshot)  # outside the lock: it may start the sender
        except Deposed as e:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {e.address}") from None
        log.info("shard %d: replicating to %s", self.shard_index, address)
        return str(rep.wait_synced(timeout) if timeout > 0 else rep.state)

    def _split_names(self) -> list[str]:
        raise NotImplementedError

    def _deposed(self, address: str) -> None:
        with self._cond:
            self.role = next_role(self.role, RoleEvent.DEPOSED)
            self.moved_to = address
            self._cond.notify_all()

    def replicated(self, timeout: float | None = None) -> None:
        """Block until every change made so far is on the backup (at once without one)."""
        rep = self.replicator
        if rep is None:
            return
        try:
            rep.wait(None, 2 * self.replica_timeout_s if timeout is None else timeout)
        except Deposed as e:
            self._deposed(e.address)
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {e.address}") from None
        except TimeoutError as e:
            raise Unavailable(str(e)) from None

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

    def apply_replica(self, ops: Iterable[tuple[Any, Op]]) -> tuple[int, int]:
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
                if self.replica_incarnation and head.incarnation != self.replica_incarnation:
                    raise FailedPrecondition(
                        f"the backup of shard {self.shard_index} here holds the state of an earlier run of its "
                        f"primary (op {self.replica_seq}, version {self.version}): a restarted primary must not "
                        f"overwrite acknowledged updates; this backup takes the shard over instead")
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
        return self.replica_seq, self.version

    def _replay(self, op: Op) -> None:
        a, t = op.args, op.tensors
        try:
            kind = OpKind(op.kind)
        except ValueError:
            raise InvalidArgument(f"unknown replication op {op.kind!r}") from None
        if kind == OpKind.SNAPSHOT:
            self.restore(a["version"], a["meta"], t)
            self.replica_synced = True
        elif kind == OpKind.CONFIGURE:
            sc = a["scaling"]
            self.configure(a["num_workers"], a["sync"], LossScaler(*sc) if sc else None, a["remedy"])
        elif kind == OpKind.REGISTER_WORKER:
            self.register_worker(a["worker"])
        elif kind == OpKind.REGISTER_TENSORS:
            self.register_tensors([spec_from_json(d) for d in a["specs"]], parse_part_keys(t))
        elif kind == OpKind.SUBMIT:
            self.submit(a["worker"], a["step"], a["base_version"], parse_part_keys(t), a["nbytes"],
                        found_inf=a["found_inf"], checked=True)
        elif kind == OpKind.LEAVE:
            self.leave(a["worker"])
        elif kind == OpKind.EVICT:
            with self._cond:
                self._evict(list(a["workers"]))
        elif kind == OpKind.SET_SYNC:
            self.set_sync(a["sync"])
        elif kind == OpKind.PULLED:
            with self._cond:
                self._remember_pulled(a["worker"], list(a["names"]))

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
        return self.shard_index, self.version, self.epoch

    def _promote(self, reason: str, force: bool) -> None:
        primary = None
        if not force:
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
                self._renew_leases()  # a fresh lease at the new address
                self.promotions_total += 1
                self._cond.notify_all()
        log.warning("shard %d: the backup at %s took over from %s at version %d (op %d): %s", self.shard_index,
                    self.address, self.primary_address, self.version, self.replica_seq, reason or "no reason given")

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
