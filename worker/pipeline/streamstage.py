"""``StageStreamer``: a pipeline stage's weights streamed from the servers, micro-batch by micro-batch.

A Ray pipeline stage is a ``DistributedOptimizer`` worker of its own
parameters; with ``Pipeline(stream=shardps.Stream(...))`` its optimizer
streams them as a data-parallel worker's does (``worker/streaming/streamer.py``: units cut
at ``nn.Module`` boundaries, storage released with ``resize_(0)``, hooks on
each unit's forward and backward), but a stage runs many micro-batches'
forwards before their backwards (GPipe, 1F1B) and may recompute a forward in
its backward. What changes here (docs/streaming.md, "Pipeline stages"):

- **Every use pulls.** A unit's weights are held for each forward call
  (with autograd or not: a forward that will be recomputed runs without)
  and each backward call of each micro-batch, and released after it, as
  FSDP does under pipeline parallelism. No micro-batch holds a unit between
  its forward and its backward: the live weights are those of the units
  running (and prefetched), whatever the number of micro-batches in flight.
- **The plan is known.** The stage's own task order for the step comes
  from the driver's plan (``begin_step``), and the order of one forward's
  unit calls is recorded from the first forward: the step's whole sequence
  of slots (each call's forward, each backward in reverse, recomputations
  included) is computed, prefetching walks it across task boundaries, and
  the released weights kept for later uses (all of a step's uses read the
  same version: no push happens before the step's last backward) are freed
  farthest next use first (Belady's rule: the plan says when each is next
  needed), never a weight needed sooner than what a prefetch would bring.
- **Gradients are summed on the host.** The gradient of micro-batch j is
  complete when its backward ends, but the push waits for the last: each is
  added, one tensor at a time as backward completes it, to a sum kept in
  host memory (the first copied, the next added in place: the resident
  stage's additions in its order, so the sums are bit for bit the same),
  and during the step's last backward each tensor's sum goes up as soon as
  it is complete (the push stream), then is freed. That costs the stage's
  gradient size in host memory between its first backward and its last
  (``peak_sum_bytes``): the price of bsp's one push a round (pushing a sum
  per micro-batch would need an accumulator per worker on the servers).
- ``keep="host"``: the first pull of a step is copied to the host, and every
  later use in the step (forwards of the next micro-batches, backwards,
  recomputations) is copied back from there instead of pulled again.

Only barrier modes (bsp, every:X): the version a step's uses read cannot move
before its push. ``StreamWeights`` (worker/pipeline/streamweights.py) is the
stage's side of it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardps.worker.datapath.bucketedpush import BucketedPush
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.optimizer import DistributedOptimizer
from shardps.worker.pipeline.schedule import Kind
from shardps.worker.streaming.plan import Slot, Stream, fits
from shardps.worker.streaming.streamer import Streamed, Streamer, _tensors

Step = Sequence[tuple[Kind, int, bool]]  # a stage's tasks of a step, in order: (kind, micro-batch, recomputed)


class StageStreamer(Streamer):
    """A ``Streamer`` for a pipeline stage (see the module docstring). Between ``begin_step`` and the
    optimizer's ``step()`` its forwards are a step's; outside (an evaluation) it streams as ``Streamer``."""

    def __init__(self, opt: Streamed, model: nn.Module, spec: Stream) -> None:
        self.training = False
        self.order: list[int] | None = None  # the unit calls of one forward of the stage, as recorded
        self._tasks: list[tuple[Kind, int, bool]] = []
        self._task: tuple[Kind, int] | None = None
        self._task_start = 0  # the running task's first call (to record a forward's order)
        self._last_backward: int | None = None
        self._pushing = False  # in the step's last backward: sums go up
        self._plan: list[tuple[Slot, int]] = []  # the step's slots in order, each with its unit
        self._index: dict[Slot, int] = {}
        self._uses: dict[str, list[int]] = {}  # name -> the plan's indices that hold it
        self._at = -1  # the plan's index of the slot entered last
        self._sums: dict[str, torch.Tensor] = {}  # the step's gradients summed over its micro-batches (host)
        self.peak_sum_bytes = 0
        self.plan_misses = 0  # forwards that went another way than the plan said (the plan was dropped)
        super().__init__(opt, model, spec)

    # -- the step's plan ------------------------------------------------------------

    def begin_step(self, tasks: Step) -> None:
        """A training step of the stage's ``tasks``, in its own order. What a failed step left is reset."""
        if self.training or self._held or self._sums:
            self.reset()
        self.training = True
        self._tasks = list(tasks)
        backs = [mb for kind, mb, _ in self._tasks if kind is Kind.BACKWARD]
        self._last_backward = backs[-1] if backs else None
        self._task, self._pushing, self._at = None, False, -1
        self._build_plan()

    def before_task(self, kind: Kind, mb: int) -> None:
        """The stage is about to run ``kind`` of micro-batch ``mb`` (its forward calls and backward follow)."""
        self._record()
        self._task, self._task_start = (kind, mb), len(self._calls)
        self._pushing = kind is Kind.BACKWARD and mb == self._last_backward

    def _record(self) -> None:
        """After the first forward task, its unit calls are the order of every forward: plan the step."""
        if self.order is None and self._task is not None and self._task[0] is Kind.FORWARD:
            calls = self._calls[self._task_start:]
            if calls and self._task_start == 0:
                self.order = list(calls)
                self._build_plan()
                self._at = self._index.get(("f", len(self._calls) - 1), -1)

    def _build_plan(self) -> None:
        self._plan, self._index, self._uses = [], {}, {}
        if self.order is None:
            return
        order, pos = self.order, 0
        kept: dict[int, list[int]] = {}  # a kept forward's call positions, by micro-batch

        def forward() -> list[int]:
            nonlocal pos
            calls = list(range(pos, pos + len(order)))
            for p, k in zip(calls, order):
                self._add(("f", p), k)
            pos += len(order)
            return calls

        for kind, mb, recomputed in self._tasks:
            if kind is Kind.FORWARD:
                calls = forward()
                if not recomputed:
                    kept[mb] = calls
            else:
                calls = forward() if recomputed else kept.pop(mb, [])
                for p, k in reversed(list(zip(calls, order))):
                    self._add(("b", p), k)

    def _add(self, slot: Slot, k: int) -> None:
        i = len(self._plan)
        self._plan.append((slot, k))
        self._index[slot] = i
        for n in self.units[k].names:
            self._uses.setdefault(n, []).append(i)

    def _drop_plan(self) -> None:
        self.plan_misses += 1
        self._plan, self._index, self._uses = [], {}, {}
        self.order = None  # recorded again from the next step's first forward

    def _next_use(self, name: str) -> float:
        """The plan's index of ``name``'s next use after now (inf: none; 0 without a plan: soon)."""
        if not self._plan:
            return 0.0
        uses = self._uses.get(name, [])
        i = bisect.bisect_right(uses, self._at)
        return float(uses[i]) if i < len(uses) else float("inf")

    # -- holding and releasing (the Streamer's, for many uses a step) ------------------

    def _use_host_copy(self, slot: Slot, name: str) -> bool:
        if not self.training:
            return super()._use_host_copy(slot, name)
        return name in self._host  # keep="host": every use after the step's first comes from the host copy

    def _release(self, slot: Slot) -> None:
        if not self.training:
            super()._release(slot)
            return
        names = self._held.pop(slot, None)
        if names is None:
            return
        for n in names:
            self._refs[n] -= 1
            if self._refs[n] == 0:
                pull = self._inflight.pop(n, None)
                ok = pull is None or _settled(pull)  # a prefetch nobody waited for: it must stop writing first
                if ok and self._next_use(n) != float("inf"):
                    self._cache[n] = None  # a later use of this step may find it here
                else:
                    self._free(n)
        self._make_room(0)

    def _make_room(self, more: int) -> None:
        """Free released weights, farthest next use first, until ``more`` bytes fit beside what is live."""
        if not self.training:
            super()._make_room(more)
            return
        live = self._weight_bytes
        while self._cache and live + more > self.spec.max_live_bytes:
            n = max(self._cache, key=self._next_use)  # ties (no plan yet): the oldest released
            del self._cache[n]
            self._free(n)
            live -= self._size[n]

    def _prefetch(self, at: Slot) -> None:
        if not self.training:
            super()._prefetch(at)
            return
        i = self._index.get(at)
        if i is None or self.spec.prefetch == 0:
            return
        for nxt, k in self._plan[i + 1: i + 1 + self.spec.prefetch]:
            if nxt in self._held:
                continue
            names, j = self.units[k].names, self._index[nxt]
            new = sum(self._size[n] for n in names if self._refs[n] == 0 and n not in self._inflight
                      and n not in self._cache)
            # Room is made only from weights not needed before this slot.
            spare = sum(self._size[n] for n in self._cache if n not in names and self._next_use(n) > j)
            if not fits(self._weight_bytes - spare, new * (2 if nxt[0] == "b" else 1), self.spec.max_live_bytes):
                return  # the budget is full: it is pulled when its turn comes
            self._acquire(nxt, k)

    # -- the hooks ----------------------------------------------------------------

    def _enter(self, slot: Slot, k: int) -> None:
        held = self._held.get(slot)
        if held is not None and held != self.units[k].names:  # prefetched for a unit the plan expected
            self._release(slot)
        if self.training:
            self._at = self._index.get(slot, self._at)
        super()._enter(slot, k)

    def _pre_forward(self, k: int, module: nn.Module, args: Any) -> None:
        if self._closed or not self.training:
            super()._pre_forward(k, module, args)  # an evaluation (or closed)
            return
        pos = len(self._calls)
        self._calls.append(k)
        planned = self._index.get(("f", pos))
        if self._plan and (planned is None or self._plan[planned][1] != k):
            self._drop_plan()  # this forward goes another way: no prefetch until it is recorded again
        self._stack.append(pos)
        self._enter(("f", pos), k)
        if torch.is_grad_enabled():
            self._inputs[pos] = [t for t in _tensors(args) if t.requires_grad]

    def _post_forward(self, k: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._closed and self.training and self.spec.keep == "host":
            for n in self.units[k].names:  # the step's first use: the copy the others come back from
                if n not in self._host:
                    self._to_host(n)
        super()._post_forward(k, module, args, output)

    def _grad_ready(self, name: str, param: torch.Tensor) -> None:
        g = param.grad
        if self._closed or g is None or not self.training:
            super()._grad_ready(name, param)
            return
        acc = self._sums.get(name)
        if not self._pushing:  # summed on the host until the step's last backward
            if acc is None:
                self._sums[name] = g.detach().to("cpu", copy=True)
            else:
                acc.add_(g.detach().to(acc.device))
            self.peak_sum_bytes = max(self.peak_sum_bytes, sum(_nbytes(t) for t in self._sums.values()))
        else:
            total = g.detach() if acc is None else acc.add_(g.detach().to(acc.device))
            self._sums.pop(name, None)
            self._hand(name, total, "in the last backward of a pipeline step")
        self._let_go(name, param, g)

    # -- step boundaries ------------------------------------------------------------

    def end_step(self) -> BucketedPush | None:
        self._record()
        push = super().end_step()
        self.training = False
        self._sums, self._task, self._pushing, self._at = {}, None, False, -1
        return push

    def stats(self) -> dict[str, float]:
        """The stage's streaming counters (bytes; seconds for ``wait_seconds``), for the driver."""
        return {"peak_live_bytes": self.peak_live_bytes, "max_live_bytes": self.spec.max_live_bytes,
                "model_bytes": self.model_bytes, "largest_unit_bytes": self.largest_unit_bytes,
                "peak_host_bytes": self.peak_host_bytes, "peak_sum_bytes": self.peak_sum_bytes,
                "pulls": self.pulls, "pulled_bytes": self.pulled_bytes, "wait_seconds": self.wait_seconds,
                "units": len(self.units), "steps": self.steps, "plan_misses": self.plan_misses}


class StageOptimizer(DistributedOptimizer):
    """A pipeline stage's ``DistributedOptimizer``: ``stream=`` runs a ``StageStreamer``."""

    streamer_class = StageStreamer


def _settled(pull: PullInFlight) -> bool:
    """Wait for ``pull`` to end (its deadline); whether it brought its weights."""
    try:
        pull.result()
    except Exception:  # noqa: BLE001 - a prefetch nobody waited for: its weights are not kept
        return False
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


__all__ = ["StageOptimizer", "StageStreamer"]
