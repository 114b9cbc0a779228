"""Which stage a failed step blames, as a table: from how each stage's part ended to the message."""

from __future__ import annotations

import pickle

import pytest

from shardps.worker.pipeline.failure import Outcome, StageFailed, blame
from shardps.worker.pipeline.plan import plan_step
from shardps.worker.pipeline.schedule import Kind, Task

F, B = Kind.FORWARD, Kind.BACKWARD
OK = [Outcome(s, "ok") for s in range(3)]
GPIPE = plan_step("gpipe", [1, 1, 1], 3, "mean")  # stage 1: F0 F1 F2 B2 B1 B0
ONE_F_ONE_B = plan_step("1f1b", [1, 1, 1, 1], 3, "mean")  # stage 1: F0 F1 B0 F2 B1 F3 B2 B3


def lost(stage, peer, kind, mb, taken=None, reason="lost"):
    return Outcome(stage, "failed", reason, None, peer, kind, mb, f"stage {stage} lost stage {peer}", taken)


TABLE = [
    # Stage 1 killed as its forward of micro-batch 2 starts: stage 0 saw it take F2's input, stage 2 waits
    # for F2 (or, its output of F1 still on its way, for F1).
    ("gpipe", [lost(0, 1, B, 2, taken=(F, 2)), Outcome(1, "died", message="ActorDiedError"), lost(2, 1, F, 2)],
     (1, 2, "forward"), "step 4: stage 1 (replica 0) died in the forward of micro-batch 2 (ActorDiedError)"),
    ("gpipe", [lost(0, 1, B, 2, taken=(F, 2)), Outcome(1, "died"), lost(2, 1, F, 1)],
     (1, 2, "forward"), "step 4: stage 1 (replica 0) died in the forward of micro-batch 2 or after it (the last "
                        "input it took)"),
    # The last stage has no input after its forwards: dead somewhere from F2 to B2.
    ("gpipe", [OK[0], lost(1, 2, B, 2, taken=(F, 2)), Outcome(2, "died")],
     (2, 2, "forward"), "step 4: stage 2 (replica 0) died in the forward of micro-batch 2 or after it (the last "
                        "input it took), the backward of micro-batch 2 the first result lost"),
    # Nothing taken: only the first result lost is known.
    ("1f1b", [lost(0, 1, B, 0), Outcome(1, "died"), lost(2, 1, F, 0, reason="timeout")],
     (1, 0, "forward"), "step 4: stage 1 (replica 0) died, the forward of micro-batch 0 the first result lost"),
    ("1f1b", [Outcome(0, "died"), lost(1, 0, F, 3, taken=(B, 0)), OK[2]],  # stage 0: F0 F1 F2 B0 F3 B1 B2 B3
     (0, 0, "backward"), "step 4: stage 0 (replica 0) died in the backward of micro-batch 0 or after it (the last "
                         "input it took), the forward of micro-batch 3 the first result lost"),
    # A result made before the last input it took (F3, then B1's input taken): it was on its way, not lost.
    ("1f1b", [Outcome(0, "died"), lost(1, 0, F, 3, taken=(B, 1)), OK[2]],
     (0, 1, "backward"), "step 4: stage 0 (replica 0) died in the backward of micro-batch 1 or after it (the last "
                         "input it took)"),
    # Its own failure, the others ended by it.
    ("1f1b", [lost(0, 1, B, 1), lost(1, 2, B, 1),
              Outcome(2, "failed", "error", Task(1, 2, B), message="FloatingPointError: injected")],
     (2, 1, "backward"), "step 4: stage 2 (replica 0) failed in the backward of micro-batch 1: FloatingPointError: "
                         "injected"),
    ("gpipe", [OK[0], Outcome(1, "failed", "sync", message="UNAVAILABLE"), OK[2]],
     (1, None, "sync"), "step 4: stage 1 (replica 0) failed to sync with the servers: UNAVAILABLE"),
    # A stage that hangs: the driver's deadline, the others' step deadlines.
    ("gpipe", [lost(0, 1, B, 2, reason="timeout"), Outcome(1, "stuck"), lost(2, 1, F, 1, reason="timeout")],
     (1, 1, "forward"), "step 4: stage 1 (replica 0) did not finish its part within 30s, the forward of micro-batch 1 "
                        "the first result lost (stage 0 lost stage 1)"),
    # No stage stuck: the one the others waited for, which waited for nobody.
    ("gpipe", [OK[0], OK[1], lost(2, 1, F, 0, reason="timeout")],
     (1, 0, "forward"), "step 4: stage 1 (replica 0) did not finish its part within 30s, the forward of micro-batch 0 "
                        "the first result lost (stage 2 lost stage 1)"),
]


@pytest.mark.parametrize("schedule, outcomes, where, message", TABLE)
def test_blame(schedule, outcomes, where, message):
    plan = GPIPE if schedule == "gpipe" else ONE_F_ONE_B
    b = blame(plan, outcomes, step=4, timeout=30)
    assert b is not None
    assert (b.stage, b.microbatch, b.kind) == where
    assert b.message == message


def test_all_ok_blames_nobody_and_states_are_checked():
    assert blame(GPIPE, OK, step=0) is None
    with pytest.raises(ValueError, match="state must be one of ok, failed, died, stuck, got 'gone'"):
        Outcome(0, "gone")


def test_a_stage_failure_crosses_processes_whole():
    e = StageFailed(lost(0, 1, B, 2, taken=(F, 2)))
    again = pickle.loads(pickle.dumps(e))
    assert again.outcome == e.outcome and str(again) == "stage 0 lost stage 1"
