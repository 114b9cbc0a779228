"""The pipeline schedules, as tables (and the properties every schedule must keep)."""

from __future__ import annotations

import itertools

import pytest

from shardps.worker.pipeline.schedule import (
    Kind,
    Task,
    bubble_fraction,
    clocks,
    max_in_flight,
    stage_orders,
    submission_order,
    table,
)

GPIPE_4_3 = [
    "F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0",
    ".  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .",
    ".  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .",
]
ONE_F_ONE_B_4_3 = [
    "F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
    ".  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .",
    ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .",
]
ONE_F_ONE_B_2_4 = [  # fewer micro-batches than stages: warm-up is cut short
    "F0 F1 .  .  .  .  .  B0 .  B1",
    ".  F0 F1 .  .  .  B0 .  B1 .",
    ".  .  F0 F1 .  B0 .  B1 .  .",
    ".  .  .  F0 B0 F1 B1 .  .  .",
]


def _rows(schedule: str, m: int, d: int) -> list[str]:
    return [" ".join(f"{c or '.':<2}" for c in row).rstrip() for row in table(schedule, m, d)]


@pytest.mark.parametrize("schedule, m, d, expected", [("gpipe", 4, 3, GPIPE_4_3), ("1f1b", 4, 3, ONE_F_ONE_B_4_3),
                                                     ("1f1b", 2, 4, ONE_F_ONE_B_2_4)])
def test_clock_tables(schedule, m, d, expected):
    assert _rows(schedule, m, d) == [r.rstrip() for r in expected]


@pytest.mark.parametrize("schedule, m, d",
                         list(itertools.product(("gpipe", "1f1b"), (1, 2, 3, 4, 8, 16), (1, 2, 3, 4))))
def test_every_schedule_runs_each_task_once_after_its_inputs_in_2_m_plus_d_minus_1_clocks(schedule, m, d):
    ticks = list(clocks(schedule, m, d))
    tasks = [t for tick in ticks for t in tick]
    assert sorted(tasks) == sorted(Task(i, s, k) for i in range(m) for s in range(d) for k in Kind)
    at = {t: c for c, tick in enumerate(ticks) for t in tick}
    for t in tasks:
        if t.kind is Kind.FORWARD and t.stage > 0:
            assert at[Task(t.microbatch, t.stage - 1, Kind.FORWARD)] < at[t]
        if t.kind is Kind.BACKWARD:
            assert at[Task(t.microbatch, t.stage, Kind.FORWARD)] < at[t]
            if t.stage < d - 1:
                assert at[Task(t.microbatch, t.stage + 1, Kind.BACKWARD)] < at[t]
    assert all(len({t.stage for t in tick}) == len(tick) for tick in ticks)  # one task per stage and clock
    assert len(ticks) == 2 * (m + d - 1)  # both schedules: the same bubble
    # A driver submits in this order; every stage then sees its own order.
    order = submission_order(schedule, m, d)
    for s, own in enumerate(stage_orders(schedule, m, d)):
        assert [t for t in order if t.stage == s] == own


@pytest.mark.parametrize("m, d", list(itertools.product((1, 4, 8, 16), (1, 2, 4))))
def test_activations_in_flight(m, d):
    assert max_in_flight("gpipe", m, d) == [m] * d
    assert max_in_flight("1f1b", m, d) == [min(m, d - s) for s in range(d)]  # at most d per stage


def test_bubble():
    assert bubble_fraction(4, 4) == 3 / 7 and bubble_fraction(16, 4) == 3 / 19 and bubble_fraction(8, 1) == 0
    for schedule in ("gpipe", "1f1b"):  # idle clocks per stage, with unit-cost tasks, are the formula's
        rows = table(schedule, 8, 4)
        assert all(row.count("") / len(row) == pytest.approx(bubble_fraction(8, 4)) for row in rows)


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b"):
        stage_orders("interleaved", 4, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        list(clocks("gpipe", 0, 2))


def test_kind_is_an_enum_ordered_forward_first():
    assert sorted([Kind.BACKWARD, Kind.FORWARD]) == [Kind.FORWARD, Kind.BACKWARD]
    assert (str(Kind.FORWARD), str(Kind.BACKWARD)) == ("F", "B")
    assert (Kind.FORWARD.word, Kind.BACKWARD.word) == ("forward", "backward")
    assert str(Task(3, 1, Kind.BACKWARD)) == "B3@1"
    assert Task(0, 0, Kind.BACKWARD) > Task(0, 0, Kind.FORWARD)
