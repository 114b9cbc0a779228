"""The plan of a pipeline step, as tables: each stage's order, the next backward, the loss weights, the options."""

from __future__ import annotations

import itertools

import pytest

from shardps.worker.pipeline.plan import PipelineOptions, loss_reduction, plan_step
from shardps.worker.pipeline.schedule import Kind, stage_orders, table

NEXT_BACKWARD_1F1B_4_3 = {  # stage -> the backwards it runs, in order (B0 B1 B2 B3 on every stage)
    0: {0: 1, 1: 2, 2: 3, 3: None},
    1: {0: 1, 1: 2, 2: 3, 3: None},
    2: {0: 1, 1: 2, 2: 3, 3: None},
}
NEXT_BACKWARD_GPIPE_4_3 = {s: {3: 2, 2: 1, 1: 0, 0: None} for s in range(3)}  # last first


@pytest.mark.parametrize("schedule, expected", [("1f1b", NEXT_BACKWARD_1F1B_4_3), ("gpipe", NEXT_BACKWARD_GPIPE_4_3)])
def test_next_backward(schedule, expected):
    plan = plan_step(schedule, [3, 3, 2, 2], 3, "mean")
    assert {s: {mb: plan.next_backward[(s, mb)] for mb in range(4)} for s in range(3)} == expected


@pytest.mark.parametrize("schedule, m, d", list(itertools.product(("gpipe", "1f1b"), (1, 3, 8), (1, 2, 4))))
def test_each_stage_runs_its_own_order_and_the_driver_every_task_once(schedule, m, d):
    plan = plan_step(schedule, [1] * m, d, "sum")
    assert [list(o) for o in plan.orders] == stage_orders(schedule, m, d)
    for s in range(d):
        assert plan.tasks_of([s]) == list(plan.orders[s])  # a stage walking alone walks its own order
    assert plan.tasks_of() == list(plan.tasks) and len(plan.tasks) == 2 * m * d
    for s, row in enumerate(table(schedule, m, d)):  # the clock table's row, read left to right, is the order
        assert [c for c in row if c] == [f"{t.kind}{t.microbatch}" for t in plan.orders[s]]
    assert (plan.chunks, plan.last_stage) == (m, d - 1)
    assert all(t.kind in (Kind.FORWARD, Kind.BACKWARD) for t in plan.tasks)


@pytest.mark.parametrize("reduction, scale, expected", [
    ("mean", 1.0, (0.4, 0.3, 0.3)),
    ("sum", 1.0, (1.0, 1.0, 1.0)),
    ("mean", 2.0, (0.8, 0.6, 0.6)),  # a replica's share (2 replicas, half the samples each): R * its share
    ("sum", 2.0, (2.0, 2.0, 2.0)),
])
def test_loss_weights(reduction, scale, expected):
    assert plan_step("gpipe", [4, 3, 3], 2, reduction, scale=scale).weights == pytest.approx(expected)


def test_options_are_checked_when_built():
    assert PipelineOptions("1f1b", 4, "never", "activations", "bf16").compress == ("bf16",)
    assert PipelineOptions(compress=None).encodings == ()
    for kwargs, message in [
        ({"schedule": "interleaved"}, "schedule must be one of gpipe, 1f1b, got 'interleaved'"),
        ({"chunks": 0}, "chunks must be a positive integer, got 0"),
        ({"chunks": True}, "chunks must be a positive integer, got True"),
        ({"checkpoint": "sometimes"}, "checkpoint must be one of"),
        ({"offload": "weights"}, "offload must be None or 'activations', got 'weights'"),
        ({"compress": "fp16"}, "compress='fp16' encodes offloaded activations: it needs offload='activations'"),
        ({"compress": "zip"}, "compress: unknown encodings"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            PipelineOptions(**kwargs)


def test_reductions():
    class Loss:
        reduction = "sum"

    assert loss_reduction(Loss(), None) == "sum" and loss_reduction(Loss(), "mean") == "mean"
    assert loss_reduction(lambda a, b: a, None) == "mean"
    with pytest.raises(ValueError, match="reduction must be one of mean, sum"):
        loss_reduction(Loss(), "max")
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, got 'max'"):
        plan_step("gpipe", [1], 1, "max")
