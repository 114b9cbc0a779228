"""The rollback decision as a table: error x phase -> action; and the step a worker goes on from (no network)."""

from __future__ import annotations

import grpc
import pytest

from shardps.protos.syncspec import SyncSpec
from shardps.worker.errors import Aborted, Evicted, ShardError, Unreachable, shard_error
from shardps.worker.job.rollback import Action, During, decide, resume_step

ABORTED = shard_error("h:1", 0, grpc.StatusCode.ABORTED, "the job was rolled back (shard 0 is in epoch 1, ...)")
EVICTED = shard_error("h:1", 0, grpc.StatusCode.FAILED_PRECONDITION, "worker 1 was evicted from shard 0 (...)")
LEFT = shard_error("h:1", 0, grpc.StatusCode.FAILED_PRECONDITION, "worker 1 left the job on shard 0: ...")
UNREACHABLE = shard_error("h:1", 0, grpc.StatusCode.UNAVAILABLE, "still unavailable after 60s and 9 retries")
INVALID = shard_error("h:1", 0, grpc.StatusCode.INVALID_ARGUMENT, "gradient of 'w': ...")

R, S, B, J = Action.RAISE, Action.RESYNC, Action.ROLLBACK, Action.REJOIN
TABLE = {
    #              JOIN  PUSH  PULL  RESYNC
    "aborted":     (S,    B,    B,    S),
    "evicted":     (R,    J,    R,    R),
    "left":        (R,    R,    R,    R),
    "unreachable": (R,    R,    R,    R),
    "invalid":     (R,    R,    R,    R),
}
ERRORS = {"aborted": ABORTED, "evicted": EVICTED, "left": LEFT, "unreachable": UNREACHABLE, "invalid": INVALID}
PHASES = (During.JOIN, During.PUSH, During.PULL, During.RESYNC)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_the_decision_table(name):
    got = tuple(decide(ERRORS[name], p) for p in PHASES)
    assert got == TABLE[name], f"{name}: {[a.name for a in got]}"


def test_the_types_decide_not_the_words():
    # A plain ShardError that says ABORTED was not mapped by the transport: not the worker's to handle.
    assert decide(ShardError("h:1", 0, grpc.StatusCode.ABORTED, "x"), During.PULL) is Action.RAISE
    assert decide(Aborted("h:1", 0, grpc.StatusCode.ABORTED, ""), During.PUSH) is Action.ROLLBACK
    assert decide(Evicted("h:1", 0, grpc.StatusCode.FAILED_PRECONDITION, ""), During.PUSH) is Action.REJOIN
    assert decide(Unreachable("h:1", 0, grpc.StatusCode.UNAVAILABLE, ""), During.PUSH) is Action.RAISE
    assert decide(ValueError("not a shard's"), During.PUSH) is Action.RAISE


@pytest.mark.parametrize(("clock", "sync", "step"), [
    (0, "bsp", 0), (7, "bsp", 7), (7, "asp", 7), (7, "ssp:2", 7), (7, "every:3", 21), (0, "every:4", 0),
])
def test_the_step_to_go_on_from(clock, sync, step):
    assert resume_step(clock, SyncSpec.parse(sync)) == step
