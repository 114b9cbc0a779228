"""The roles of a shard and the ops it records for its backup: types instead of strings, and tables.

A leaf module: the store's parts, the replica side and the gRPC replication
all import it; it imports no other server module.

- ``Role`` of a store, ``ReplicaState`` of the primary's replicator,
  ``OpKind`` of a replication op: str-valued enums where they go on the wire
  or into stats (the formats are unchanged). Their allowed transitions are
  the tables ``ROLE_TRANSITIONS`` and ``REPLICA_TRANSITIONS`` (tested in
  tests/server/test_replica.py); anything else raises ``InvalidTransition``.
- ``Recorder``: what a part that changes the shard's state is given to
  record each change for the backup (the replica side implements it; a
  shard without a backup records nothing). Called under the store's lock.
- ``Fence``: who serves the shard, as a coordinator says it
  (server/coordinator.py's ``ShardLease`` over etcd); ``FenceError`` what it
  raises when it refuses or cannot be asked.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import torch


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
    """The primary's replica (see the diagram in server/replication/transport.py)."""

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
    ROWS = "rows"  # a row table's change (server/rows/tables.py): registered, stepped or assigned


class Recorder(Protocol):
    """Where a part records each change of the shard's state that the backup must replay (under the lock)."""

    @property
    def recording(self) -> bool:
        """Whether there is a backup to record for (without one, ``record`` does nothing)."""
        ...

    def record(self, kind: OpKind, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
               packed: Any = None) -> None:
        """Record one op: ``args`` JSON-able, ``tensors`` copies the op owns, or ``packed`` (snapshot.Packed)."""
        ...


class NoRecorder:
    """A ``Recorder`` for a part built alone (tests): there is never a backup."""

    recording = False

    def record(self, kind: OpKind, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
               packed: Any = None) -> None:
        pass


class FenceError(RuntimeError):
    """The coordinator refused a change of the shard's primary, or could not be asked: the message says why."""


class Fence(Protocol):
    """A shard's hold in the coordinator (``--coordinator``; server/coordinator.py ``ShardLease``). Its calls
    go to the network: never made under the store's lock or the replay lock."""

    @property
    def epoch(self) -> int:
        """The fencing epoch this server last wrote or read (raised by every change of primary)."""
        ...

    def why_not(self) -> str:
        """Why this server may not acknowledge a write of the shard now ("" when it may): no lease, a lease
        not renewed within its time-to-live less the margin, or one another server took."""
        ...

    def take_over(self, expected_primary: str) -> Any:
        """Become the primary (a backup's takeover) if the coordinator agrees; ``FenceError`` why not."""
        ...

    def go_alone(self) -> bool:
        """Record that the primary serves without its backup; False when it could not (refuse writes then)."""
        ...

    @property
    def alone(self) -> bool:
        """Whether the coordinator records that this primary serves without its backup."""
        ...

    def wants_together(self) -> bool:
        """Whether the coordinator may still record this primary alone (its backup back in sync since)."""
        ...

    def back_together(self) -> bool:
        """Record that the primary serves with its backup again (in sync); False when it could not yet."""
        ...
