"""Which stage a failed pipeline step blames, from how each stage's part of the step ended. Pure.

Each stage walks its own part of the plan and hands values to its neighbours
directly; when one fails, the others learn it through their link (its
connections close, or the step's deadline passes) and end too. The driver
then holds one ``Outcome`` per stage: ``ok``; ``failed`` (the stage raised
``StageFailed``: its own task failed, ``reason`` ``"error"`` or ``"sync"``, or
its link did, ``reason`` ``"lost"``, ``"timeout"``, ``"mismatch"`` or ``"send"``
with the value it waited for or sent); ``died`` (its process ended: nothing
from it); ``stuck`` (no answer by the driver's deadline). ``blame`` names the
cause:

1. a stage that died: in the task whose input it took last (a neighbour's
   value it took, ``taken``) or a later one, and at the latest in the first
   of its tasks whose result its neighbours did not get (the value they waited
   for from it, or sent it and it never took); named by the first when known;
2. else a stage whose own task failed (the error, or the push and pull of the
   step, ``"sync"``);
3. else a stage that did not answer, or that the others waited for in vain,
   at the first result its neighbours did not get.

tests/worker/test_failure.py checks it as a table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardps.worker.pipeline.plan import StepPlan
from shardps.worker.pipeline.schedule import Kind, Task

STATES = ("ok", "failed", "died", "stuck")
LINK_REASONS = ("lost", "timeout", "mismatch", "send")


@dataclass(frozen=True)
class Outcome:
    """How stage ``stage``'s part of a step ended (see the module docstring). ``task``: the task it ran
    when it failed; ``peer``/``kind``/``microbatch``: with a link reason, the neighbour and the value it
    waited for from it (``"send"``: sent to it); ``message``: the stage's own words; ``taken``: the last
    of its values that neighbour took, (kind, micro-batch), when known."""

    stage: int
    state: str
    reason: str = ""
    task: Task | None = None
    peer: int | None = None
    kind: Kind | None = None
    microbatch: int | None = None
    message: str = ""
    taken: tuple[Kind, int] | None = None  # the last of this stage's values ``peer`` took

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, got {self.state!r}")


class StageFailed(RuntimeError):
    """Raised by a stage whose part of a step failed; carries its ``Outcome``."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.message)
        self.outcome = outcome

    def __reduce__(self) -> Any:  # pickles with its outcome (it crosses process boundaries)
        return (StageFailed, (self.outcome,))


@dataclass(frozen=True)
class Blame:
    """The cause of a failed step: ``stage``, ``microbatch`` (None when nothing says) and ``kind``
    (``"forward"``, ``"backward"``, ``"sync"`` or None), and a message that says so."""

    stage: int
    microbatch: int | None
    kind: str | None
    message: str


def _first_lost(plan: StepPlan, stage: int, outcomes: Sequence[Outcome]) -> Task | None:
    """The first task of ``stage``'s order whose result a neighbour waited for in vain, or whose input it
    never took."""
    tasks = set()
    for o in outcomes:
        if o.peer != stage or o.kind is None or o.microbatch is None or o.reason not in LINK_REASONS:
            continue
        tasks.add(Task(o.microbatch, stage, o.kind))  # its output awaited, or (send) its input not taken
    order = plan.orders[stage]
    return next((t for t in order if t in tasks), None)


def _last_taken(plan: StepPlan, stage: int, outcomes: Sequence[Outcome]) -> Task | None:
    """The last task of ``stage``'s order whose input it took from a neighbour (it got that far)."""
    tasks = {Task(o.taken[1], stage, o.taken[0]) for o in outcomes if o.peer == stage and o.taken is not None}
    return next((t for t in reversed(plan.orders[stage]) if t in tasks), None)


def _at(task: Task | None) -> str:
    return f", the {task.kind.word} of micro-batch {task.microbatch} the first result lost" if task else ""


def _name(task: Task) -> str:
    return f"the {task.kind.word} of micro-batch {task.microbatch}"


def blame(plan: StepPlan, outcomes: Sequence[Outcome], *, step: int, replica: int = 0,
          timeout: float | None = None) -> Blame | None:
    """The cause of a failed step of pipeline replica ``replica`` (None when every stage is ok)."""
    if all(o.state == "ok" for o in outcomes):
        return None
    head = f"step {step}: stage"
    for o in outcomes:
        if o.state == "died":
            lost, got = _first_lost(plan, o.stage, outcomes), _last_taken(plan, o.stage, outcomes)
            order = plan.orders[o.stage]
            if got and lost and order.index(lost) < order.index(got):
                lost = None  # a result made before the input it took last: still on its way as it died
            t = got or lost
            where = ""
            if got:
                where = f" in {_name(got)}" if got == lost else f" in {_name(got)} or after it (the last input it took)"
            why = f" ({o.message})" if o.message else ""
            return Blame(o.stage, t.microbatch if t else None, t.kind.word if t else None,
                         f"{head} {o.stage} (replica {replica}) died{where}{_at(lost if lost != got else None)}{why}")
    for o in outcomes:
        if o.state == "failed" and o.reason in ("error", "sync"):
            if o.reason == "sync":
                return Blame(o.stage, None, "sync", f"{head} {o.stage} (replica {replica}) failed to sync with the "
                                                    f"servers: {o.message}")
            t = o.task
            where = f" in the {t.kind.word} of micro-batch {t.microbatch}" if t else ""
            return Blame(o.stage, t.microbatch if t else None, t.kind.word if t else None,
                         f"{head} {o.stage} (replica {replica}) failed{where}: {o.message}")
    waiting = {o.stage for o in outcomes if o.state == "failed" and o.reason in LINK_REASONS}
    suspects = [o.stage for o in outcomes if o.state == "stuck"] or \
        [o.peer for o in outcomes if o.peer is not None and o.peer not in waiting] or \
        [o.peer for o in outcomes if o.peer is not None] or [o.stage for o in outcomes if o.state != "ok"]
    s = suspects[0]
    t = _first_lost(plan, s, outcomes)
    within = f" within {timeout:g}s" if timeout is not None else ""
    told = next((f" ({o.message})" for o in outcomes if o.peer == s and o.message), "")
    return Blame(s, t.microbatch if t else None, t.kind.word if t else None,
                 f"{head} {s} (replica {replica}) did not finish its part{within}{_at(t)}{told}")
