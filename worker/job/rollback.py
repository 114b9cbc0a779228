"""What a worker does when a shard refuses its push or pull: the rollback decision, as a pure function.

``decide(error, during)`` is the whole policy of ``DistributedOptimizer``;
the optimizer carries the action out. ``during`` is where the error came from:

| during | ``Aborted`` (rolled back / restarted) | ``Evicted`` (lease expired) | any other error |
| --- | --- | --- | --- |
| ``JOIN``: the pull after registering | ``RESYNC`` | ``RAISE`` | ``RAISE`` |
| ``PUSH``: a step's push | ``ROLLBACK`` | ``REJOIN`` | ``RAISE`` |
| ``PULL``: a step's pull | ``ROLLBACK`` | ``RAISE`` | ``RAISE`` |
| ``RESYNC``: the pull after recovering | ``RESYNC`` (again, a bounded number of times) | ``RAISE`` | ``RAISE`` |

``resume_step`` is the optimizer step a worker goes on from after it
(re)joined or resynced: its clock (syncs pushed) times the steps per sync.
"""

from __future__ import annotations

from enum import Enum

from shardps.protos.syncspec import SyncSpec
from shardps.worker.errors import Aborted, Evicted


class During(Enum):
    JOIN = "join"  # the pull that follows registering (joining or rejoining a job)
    PUSH = "push"  # a step's push
    PULL = "pull"  # a step's pull, after its push
    RESYNC = "resync"  # the pull that follows recover()


class Action(Enum):
    RAISE = "raise"  # not the worker's to handle: the error goes to the caller as it is
    RESYNC = "resync"  # take the job's epoch, clock and weights (recover, pull), then go on
    ROLLBACK = "rollback"  # resync, then raise RolledBack(step) to the training loop: it redoes from that step
    REJOIN = "rejoin"  # register again and pull the current weights; this step's gradient is dropped


def decide(error: BaseException, during: During) -> Action:
    """The action for ``error``, raised by a push or pull ``during`` a phase of the optimizer."""
    if isinstance(error, Aborted):
        return Action.ROLLBACK if during in (During.PUSH, During.PULL) else Action.RESYNC
    if isinstance(error, Evicted) and during is During.PUSH:
        # The others went on without us (we were too slow, or cut off): this gradient is too stale to keep.
        return Action.REJOIN
    return Action.RAISE


def resume_step(clock: int, sync: SyncSpec) -> int:
    """The optimizer step (calls of ``step()``) a worker at ``clock`` syncs goes on from."""
    return clock * sync.accumulation
