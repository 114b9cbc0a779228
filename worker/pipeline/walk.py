"""The walker: runs a ``StepPlan``'s tasks on stages, handing activations and gradients over a ``Link``.

One walk serves every driver. What a task does is the same everywhere::

    F mb @ s:  x = inputs[mb] (s = 0) or link.recv(F, s - 1, mb)
               y = stage.forward(mb, x);  link.send(F, s, mb, y)      (not on the last stage)
    B mb @ s:  last stage: g, loss = stage.backward(mb, None, targets[mb], weights[mb], next_mb)
               otherwise:  g, _ = stage.backward(mb, link.recv(B, s + 1, mb), None, weights[mb], next_mb)
               link.send(B, s, mb, g)                                  (not on the first stage)

What varies is injected: ``StageCalls`` runs a stage's task (a ``StageRuntime``
in this process, or the stage actor's own calls on Ray), and ``Link`` carries
what one stage hands its neighbour. ``walk`` runs the tasks of any set of
stages in submission order: all of them (one driver: ``LocalPipeline``, its
link a ``Mailbox``) or one (a stage walking its own part of the plan: each Ray
stage actor, its link a ``GroupLink`` to the neighbours' processes; or stages
in threads over one ``Mailbox``, which blocks until the value is there).
``walk_eval`` runs forwards only (inference) the same way.

Pure: no torch, no Ray. tests/worker/test_walk.py checks it as tables.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from shardps.worker.pipeline.plan import StepPlan
from shardps.worker.pipeline.schedule import Kind, Task

V = TypeVar("V")  # what stages hand over: a tensor (names in the tests)
L = TypeVar("L", covariant=True)  # a last-stage backward's loss: a float, or a reference to one


class StageCalls(Protocol[V, L]):
    """A stage's two calls, as the walker makes them (``StageRuntime`` is one; the Ray stage actor, which
    adds its weights' side, another). Called one at a time, in the stage's own order."""

    def forward(self, mb: int, x: V, /) -> V:
        """The forward of micro-batch ``mb`` on input ``x``; its output for the next stage."""
        ...

    def backward(self, mb: int, grad: V | None, target: V | None, weight: float, next_mb: int | None,
                 /) -> tuple[V | None, L]:
        """The backward of ``mb`` from the output gradient ``grad`` or, on the last stage, from the loss
        against ``target`` times ``weight`` (the micro-batch's loss weight, given to every stage: a stage's
        own loss terms, as an MoE's balancing loss, weigh the same); the input gradient and the weighted
        loss. ``next_mb``: the next backward on this stage (None: none)."""
        ...


class Link(Protocol[V]):
    """Carries what a stage hands its neighbour. ``send(kind, stage, mb, value)``: stage ``stage``'s
    forward output of ``mb`` (kind F, for stage + 1) or its input gradient (kind B, for stage - 1);
    ``recv`` takes it once, blocking until it is there or raising ``TimeoutError``."""

    def send(self, kind: Kind, stage: int, mb: int, value: V | None, /) -> None: ...

    def recv(self, kind: Kind, stage: int, mb: int, /) -> V | None: ...


class Mailbox(Generic[V]):
    """A ``Link`` within one process: a value waits in a dict until its receiver takes it. Thread-safe;
    ``recv`` waits up to ``timeout`` seconds and says, when that expires, what it waited for."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._items: dict[tuple[Kind, int, int], V | None] = {}
        self._cond = threading.Condition()

    def send(self, kind: Kind, stage: int, mb: int, value: V | None, /) -> None:
        with self._cond:
            self._items[(kind, stage, mb)] = value
            self._cond.notify_all()

    def recv(self, kind: Kind, stage: int, mb: int, /) -> V | None:
        key = (kind, stage, mb)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._items:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left) and key not in self._items:
                    raise TimeoutError(f"waited {self.timeout:g}s for the {kind.word} output of micro-batch "
                                       f"{mb} from stage {stage}")
            return self._items.pop(key)

    def __len__(self) -> int:
        """Values sent and not yet taken."""
        with self._cond:
            return len(self._items)


def run_task(plan: StepPlan, task: Task, stage: StageCalls[V, L], link: Link[V], inputs: Sequence[V],
             targets: Sequence[V]) -> L | None:
    """Run one task (see the module docstring); the loss of a last-stage backward, else None."""
    s, mb, last = task.stage, task.microbatch, plan.last_stage
    if task.kind is Kind.FORWARD:
        x = inputs[mb] if s == 0 else link.recv(Kind.FORWARD, s - 1, mb)
        if x is None:
            raise ValueError(f"stage {s - 1} handed stage {s} no output for micro-batch {mb}")
        y = stage.forward(mb, x)
        if s < last:
            link.send(Kind.FORWARD, s, mb, y)
        return None
    nxt = plan.next_backward[(s, mb)]
    if s == last:
        g, loss = stage.backward(mb, None, targets[mb], plan.weights[mb], nxt)
    else:
        g, loss = stage.backward(mb, link.recv(Kind.BACKWARD, s + 1, mb), None, plan.weights[mb], nxt)
    if s > 0:
        link.send(Kind.BACKWARD, s, mb, g)
    return loss if s == last else None


def walk(plan: StepPlan, stages: Mapping[int, StageCalls[V, L]], link: Link[V], inputs: Sequence[V] | None,
         targets: Sequence[V] | None) -> list[L]:
    """Run every task of the stages in ``stages`` (stage index -> its calls) in submission order: one
    stage's own order when it is alone. ``inputs`` (micro-batches of the batch) are read by stage 0 and
    ``targets`` by the last stage: each may be None when that stage is not walked here. Returns the last
    stage's losses in the order its backwards ran (empty when the last stage is not walked here)."""
    unknown = sorted(s for s in stages if not 0 <= s < plan.num_stages)
    if unknown:
        raise ValueError(f"stages {unknown} are not in a plan of {plan.num_stages} stages")
    need_in, need_tg = 0 in stages, plan.last_stage in stages
    if need_in and (inputs is None or len(inputs) != plan.chunks) or \
            need_tg and (targets is None or len(targets) != plan.chunks):
        raise ValueError(f"the plan has {plan.chunks} micro-batches, got "
                         f"{'no' if inputs is None else len(inputs)} inputs and "
                         f"{'no' if targets is None else len(targets)} targets")
    losses: list[L] = []
    for t in plan.tasks_of(sorted(stages)):
        loss = run_task(plan, t, stages[t.stage], link, inputs or (), targets or ())
        if loss is not None:
            losses.append(loss)
    return losses


class EvalCalls(Protocol[V]):
    """A stage's forward in eval mode (no gradients, nothing kept): ``StageRuntime.eval_forward``."""

    def eval_forward(self, x: V, /) -> V: ...


def walk_eval(num_stages: int, chunks: int, stages: Mapping[int, EvalCalls[V]], link: Link[V],
              inputs: Sequence[V] | None) -> list[V]:
    """Forwards only: ``chunks`` micro-batches through the stages in ``stages``, micro-batch after
    micro-batch, handed over the link as a step's forwards are. Stage 0 reads ``inputs``; returns the
    last stage's outputs in order (empty when it is not walked here)."""
    if 0 in stages and (inputs is None or len(inputs) != chunks):
        raise ValueError(f"eval of {chunks} micro-batches, got {'no' if inputs is None else len(inputs)} inputs")
    outs: list[V] = []
    for mb in range(chunks):
        for s in sorted(stages):
            x = inputs[mb] if s == 0 and inputs is not None else link.recv(Kind.FORWARD, s - 1, mb)
            if x is None:
                raise ValueError(f"stage {s - 1} handed stage {s} no output for micro-batch {mb}")
            y = stages[s].eval_forward(x)
            if s < num_stages - 1:
                link.send(Kind.FORWARD, s, mb, y)
            else:
                outs.append(y)
    return outs
