"""The plan of a pipeline: its options checked once, and one step's tasks per stage.

``PipelineOptions`` is what both pipelines (``LocalPipeline``, the Ray
``Pipeline``) accept and refuse alike, checked before anything runs.
``StepPlan`` is a step as data: each stage's own task order (what that stage
runs, one task at a time), every task once in an order a single driver can
submit (``schedule.submission_order``), the backward that follows each one on
its stage (to prefetch its offloaded activations) and every micro-batch's loss
weight. It is pure (no torch, no Ray): tests/worker/test_plan.py checks it as
tables. ``walk.py`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardps.worker.pipeline.offload import check_compress
from shardps.worker.pipeline.schedule import SCHEDULES, Kind, Task, stage_orders, submission_order
from shardps.worker.pipeline.stage import check_checkpoint

REDUCTIONS = ("mean", "sum")
OFFLOADS = (None, "activations")


def loss_reduction(loss_fn: Callable[..., Any], reduction: str | None) -> str:
    """``reduction`` if given, else the loss module's own (``nn.CrossEntropyLoss().reduction``), else mean."""
    r = reduction or getattr(loss_fn, "reduction", None) or "mean"
    if r not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)} (the loss of a batch is the mean or "
                         f"the sum of its samples'), got {r!r}")
    return str(r)


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipeline runs a step, checked when built (``ValueError`` naming the option and the value).

    ``schedule``: one of ``SCHEDULES``; ``chunks``: micro-batches per step (>= 1); ``checkpoint``: a
    recomputation mode (``stage.CHECKPOINT_MODES``); ``offload``: ``None`` or ``"activations"``;
    ``compress``: encodings of saved activations (normalised to a tuple; the lossy ones need offload)."""

    schedule: str = "gpipe"
    chunks: int = 1
    checkpoint: str = "except_last"
    offload: str | None = None
    compress: str | Sequence[str] | None = ()

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {self.chunks!r}")
        check_checkpoint(self.checkpoint)
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be None or 'activations', got {self.offload!r}")
        compress = check_compress(self.compress)
        lossy = [c for c in compress if c in ("bf16", "fp16")]
        if lossy and not self.offload:
            raise ValueError(f"compress={lossy[0]!r} encodes offloaded activations: it needs "
                             f"offload='activations' ('relu-mask' alone works without)")
        object.__setattr__(self, "compress", compress)

    @property
    def encodings(self) -> tuple[str, ...]:
        """``compress`` as the checked tuple."""
        return check_compress(self.compress)


@dataclass(frozen=True)
class StepPlan:
    """One step of ``num_stages`` stages over micro-batches of ``sizes`` samples (see the module docstring).

    ``orders[s]``: stage s's tasks in the order it runs them; ``tasks``: every task once, in an order
    that respects the data dependencies and each stage's own order; ``next_backward[(s, mb)]``: the
    micro-batch whose backward follows mb's on stage s (None after the last); ``weights[mb]``: the
    factor of micro-batch mb's loss."""

    schedule: str
    num_stages: int
    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    orders: tuple[tuple[Task, ...], ...]
    tasks: tuple[Task, ...]
    next_backward: Mapping[tuple[int, int], int | None]

    @property
    def chunks(self) -> int:
        """The number of micro-batches."""
        return len(self.sizes)

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1

    def tasks_of(self, stages: Sequence[int] | None = None) -> list[Task]:
        """The tasks of ``stages`` (all when None) in submission order; for one stage its own order."""
        if stages is None:
            return list(self.tasks)
        own = set(stages)
        return [t for t in self.tasks if t.stage in own]


def plan_step(schedule: str, sizes: Sequence[int], num_stages: int, reduction: str,
              scale: float = 1.0) -> StepPlan:
    """The plan of one step. ``reduction`` ``"mean"``: micro-batch j's loss weighs ``sizes[j] / sum(sizes)``
    (the batch's loss is the mean of its samples'); ``"sum"``: 1. ``scale`` multiplies every weight (a
    pipeline replica's share when the servers average the replicas' gradients)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    m, total = len(sizes), sum(sizes)
    orders = tuple(tuple(order) for order in stage_orders(schedule, m, num_stages))
    nxt: dict[tuple[int, int], int | None] = {}
    for s, order in enumerate(orders):
        backs: list[int | None] = [t.microbatch for t in order if t.kind is Kind.BACKWARD]
        for a, b in zip(backs, backs[1:] + [None]):
            assert a is not None
            nxt[(s, a)] = b
    weights = tuple((n / total if reduction == "mean" else 1.0) * scale for n in sizes)
    return StepPlan(schedule, num_stages, tuple(sizes), weights, orders,
                    tuple(submission_order(schedule, m, num_stages)), nxt)
