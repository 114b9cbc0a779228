"""Pipeline schedules as pure generators: which (micro-batch, stage, forward|backward) runs at each clock.

No threads, no Ray, no torch: the runtime only walks what these yield.
tests/worker/test_schedule.py checks them as tables.

GPipe, d = 3 stages, m = 4 micro-batches (``F2`` = forward of micro-batch 2),
all forwards, then all backwards in reverse::

    clock:     0   1   2   3   4   5   6   7   8   9  10  11
    stage 0    F0  F1  F2  F3                  B3  B2  B1  B0
    stage 1        F0  F1  F2  F3          B3  B2  B1  B0
    stage 2            F0  F1  F2  F3  B3  B2  B1  B0

(``torchgpipe.clock_cycles`` for the forward half: m + d - 1 ticks each way.)
Every stage holds the activations of all m micro-batches before its first
backward.

1F1B (PipeDream-flush), the same d and m: stage s runs d - s - 1 warm-up
forwards, then alternates one forward and one backward, then drains::

    clock:     0   1   2   3   4   5   6   7   8   9  10  11
    stage 0    F0  F1  F2          B0  F3  B1      B2      B3
    stage 1        F0  F1      B0  F2  B1  F3  B2      B3
    stage 2            F0  B0  F1  B1  F2  B2  F3  B3

Same length (so the same bubble, (d - 1) / (m + d - 1) of each stage idle),
but stage s holds at most d - s micro-batches' activations at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

SCHEDULES = ("gpipe", "1f1b")


class Kind(Enum):
    """What a task runs: a micro-batch's forward or its backward. Ordered forward before backward (so
    tasks sort); ``str()`` is the letter of the tables, ``word`` the name errors use."""

    FORWARD = "F"
    BACKWARD = "B"

    def __lt__(self, other: Kind) -> bool:
        return self is Kind.FORWARD and other is Kind.BACKWARD

    def __str__(self) -> str:
        return self.value

    @property
    def word(self) -> str:
        """``"forward"`` or ``"backward"``."""
        return "forward" if self is Kind.FORWARD else "backward"


F, B = Kind.FORWARD, Kind.BACKWARD


@dataclass(frozen=True, order=True)
class Task:
    """One unit of work: the forward or backward (``kind``) of micro-batch ``microbatch`` on stage ``stage``."""

    microbatch: int
    stage: int
    kind: Kind

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


def _check(m: int, d: int) -> None:
    if m < 1 or d < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got m={m}, d={d}")


def gpipe_order(m: int, d: int, stage: int) -> list[Task]:
    """What stage ``stage`` runs under GPipe, in order: every forward, then every backward, last first."""
    _check(m, d)
    return [Task(i, stage, F) for i in range(m)] + [Task(i, stage, B) for i in reversed(range(m))]


def one_f_one_b_order(m: int, d: int, stage: int) -> list[Task]:
    """What stage ``stage`` runs under 1F1B: d - stage - 1 warm-up forwards, one forward one backward, drain."""
    _check(m, d)
    warmup = min(m, d - stage - 1)
    out = [Task(i, stage, F) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            out.append(Task(f, stage, F))
            f += 1
        out.append(Task(b, stage, B))
        b += 1
    return out


def stage_orders(schedule: str, m: int, d: int) -> list[list[Task]]:
    """Each stage's tasks, in the order that stage runs them."""
    if schedule == "gpipe":
        return [gpipe_order(m, d, s) for s in range(d)]
    if schedule == "1f1b":
        return [one_f_one_b_order(m, d, s) for s in range(d)]
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def _ready(t: Task, done: set[Task], d: int) -> bool:
    if t.kind is F:
        return t.stage == 0 or Task(t.microbatch, t.stage - 1, F) in done
    # A backward needs its own forward, and the next stage's backward (the last stage: the loss).
    return Task(t.microbatch, t.stage, F) in done and (
        t.stage == d - 1 or Task(t.microbatch, t.stage + 1, B) in done)


def clocks(schedule: str, m: int, d: int) -> Iterator[list[Task]]:
    """The tasks that run at each clock tick: every stage runs the next task of its order as soon as its
    inputs exist (one tick per task). Raises if the orders can deadlock (they cannot for these two)."""
    orders = stage_orders(schedule, m, d)
    pos = [0] * d
    done: set[Task] = set()
    while any(p < len(o) for p, o in zip(pos, orders)):
        tick = [orders[s][pos[s]] for s in range(d) if pos[s] < len(orders[s])
                and _ready(orders[s][pos[s]], done, d)]
        if not tick:
            raise RuntimeError(f"schedule {schedule} deadlocks at {[o[p] for o, p in zip(orders, pos) if p < len(o)]}")
        for t in tick:
            pos[t.stage] += 1
        done.update(tick)
        yield tick


def submission_order(schedule: str, m: int, d: int) -> list[Task]:
    """Every task once, in an order that respects both the data dependencies and each stage's own order
    (what one loop that runs every stage runs: ``LocalPipeline``; on Ray each stage runs its own order)."""
    return [t for tick in clocks(schedule, m, d) for t in tick]


def max_in_flight(schedule: str, m: int, d: int) -> list[int]:
    """Per stage: the most micro-batches whose forward has run and whose backward has not, at any time."""
    out = []
    for order in stage_orders(schedule, m, d):
        live = peak = 0
        for t in order:
            live += 1 if t.kind is F else -1
            peak = max(peak, live)
        out.append(peak)
    return out


def bubble_fraction(m: int, d: int) -> float:
    """The idle share of each stage with equal-cost stages, for both schedules: (d - 1) / (m + d - 1)."""
    _check(m, d)
    return (d - 1) / (m + d - 1)


def table(schedule: str, m: int, d: int) -> list[list[str]]:
    """The clock table as text cells, ``table[stage][clock]`` ("F0", "B3" or "" when idle)."""
    ticks = list(clocks(schedule, m, d))
    rows = [[""] * len(ticks) for _ in range(d)]
    for c, tick in enumerate(ticks):
        for t in tick:
            rows[t.stage][c] = f"{t.kind}{t.microbatch}"
    return rows
