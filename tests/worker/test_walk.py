"""The walker, as tables: which call each task makes, what it hands over, for one driver or a stage alone."""

from __future__ import annotations

import threading

import pytest

from shardps.worker.pipeline.plan import plan_step
from shardps.worker.pipeline.schedule import Kind
from shardps.worker.pipeline.walk import Mailbox, walk


class Recorder:
    """A stage whose values are names: ``y<mb>.<stage>`` a forward's output, ``g<mb>.<stage>`` an input
    gradient (none on stage 0); every call is written to ``log``."""

    def __init__(self, stage: int, log: list[str]) -> None:
        self.stage, self.log = stage, log

    def forward(self, mb: int, x: str, /) -> str:
        y = f"y{mb}.{self.stage}"
        self.log.append(f"F{mb}@{self.stage} {x} -> {y}")
        return y

    def backward(self, mb: int, grad: str | None, target: str | None, weight: float, next_mb: int | None,
                 /) -> tuple[str | None, str]:
        g = f"g{mb}.{self.stage}" if self.stage > 0 else None
        self.log.append(f"B{mb}@{self.stage} {grad or target} w={weight:g} next={next_mb} -> {g}")
        return g, f"loss{mb}"


GPIPE_2_2 = [  # sizes 2, 2 under mean: each loss weighs 0.5
    "F0@0 x0 -> y0.0",
    "F1@0 x1 -> y1.0",
    "F0@1 y0.0 -> y0.1",
    "F1@1 y1.0 -> y1.1",
    "B1@1 t1 w=0.5 next=0 -> g1.1",
    "B1@0 g1.1 w=0.5 next=0 -> None",
    "B0@1 t0 w=0.5 next=None -> g0.1",
    "B0@0 g0.1 w=0.5 next=None -> None",
]
ONE_F_ONE_B_3_2 = [  # sizes 2, 1, 1
    "F0@0 x0 -> y0.0",
    "F1@0 x1 -> y1.0",
    "F0@1 y0.0 -> y0.1",
    "B0@1 t0 w=0.5 next=1 -> g0.1",
    "B0@0 g0.1 w=0.5 next=1 -> None",
    "F1@1 y1.0 -> y1.1",
    "F2@0 x2 -> y2.0",
    "B1@1 t1 w=0.25 next=2 -> g1.1",
    "B1@0 g1.1 w=0.25 next=2 -> None",
    "F2@1 y2.0 -> y2.1",
    "B2@1 t2 w=0.25 next=None -> g2.1",
    "B2@0 g2.1 w=0.25 next=None -> None",
]


def _walk(schedule: str, sizes: list[int], d: int, stages: list[int] | None = None,
          link: Mailbox[str] | None = None, log: list[str] | None = None) -> tuple[list[str], list[str]]:
    plan = plan_step(schedule, sizes, d, "mean")
    log = [] if log is None else log
    m = len(sizes)
    losses = walk(plan, {s: Recorder(s, log) for s in (range(d) if stages is None else stages)},
                  Mailbox[str]() if link is None else link, [f"x{i}" for i in range(m)], [f"t{i}" for i in range(m)])
    return log, losses


@pytest.mark.parametrize("schedule, sizes, d, expected, losses", [
    ("gpipe", [2, 2], 2, GPIPE_2_2, ["loss1", "loss0"]),
    ("1f1b", [2, 1, 1], 2, ONE_F_ONE_B_3_2, ["loss0", "loss1", "loss2"]),
])
def test_one_driver_walks_every_stage(schedule, sizes, d, expected, losses):
    assert _walk(schedule, sizes, d) == (expected, losses)


@pytest.mark.parametrize("schedule, sizes, d", [("gpipe", [2, 2], 2), ("1f1b", [2, 1, 1], 2), ("1f1b", [1] * 5, 4),
                                                ("gpipe", [1] * 3, 3)])
def test_each_stage_walking_its_own_part_in_its_own_thread_makes_the_same_calls(schedule, sizes, d):
    """The shape the next step takes: a stage walks its own tasks; the link hands values to its neighbour."""
    whole, losses = _walk(schedule, sizes, d)
    link: Mailbox[str] = Mailbox(timeout=60)
    logs: dict[int, list[str]] = {s: [] for s in range(d)}
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def run(s: int) -> None:
        try:
            got[s] = _walk(schedule, sizes, d, [s], link, logs[s])[1]
        except BaseException as e:  # noqa: BLE001 - raised in the test below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in reversed(range(d))]  # the last starts first
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(got) == d
    for s in range(d):
        assert logs[s] == [c for c in whole if c.split()[0].endswith(f"@{s}")]
    assert got[d - 1] == losses and all(got[s] == [] for s in range(d - 1))
    assert len(link) == 0  # everything sent was taken


def test_a_stage_alone_waits_for_its_neighbour_with_a_deadline():
    with pytest.raises(TimeoutError, match="for the forward output of micro-batch 0 from stage 0"):
        _walk("gpipe", [1, 1], 2, [1], Mailbox(timeout=0.05))


def test_mailbox_hands_each_value_over_once():
    box: Mailbox[str] = Mailbox(timeout=0.01)
    box.send(Kind.BACKWARD, 2, 1, "g")
    assert box.recv(Kind.BACKWARD, 2, 1) == "g"
    with pytest.raises(TimeoutError, match="backward output of micro-batch 1 from stage 2"):
        box.recv(Kind.BACKWARD, 2, 1)


def test_inputs_and_stages_must_fit_the_plan():
    plan = plan_step("gpipe", [1, 1], 2, "sum")
    with pytest.raises(ValueError, match="the plan has 2 micro-batches, got 1 inputs and 2 targets"):
        walk(plan, {0: Recorder(0, [])}, Mailbox[str](), ["x0"], ["t0", "t1"])
    with pytest.raises(ValueError, match=r"stages \[2\] are not in a plan of 2 stages"):
        walk(plan, {2: Recorder(2, [])}, Mailbox[str](), ["x0", "x1"], ["t0", "t1"])
