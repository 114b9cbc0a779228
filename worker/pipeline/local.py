"""The step of a pipeline, and ``LocalPipeline``: all stages in this process, one task at a time.

``StepPlan`` is what any driver needs for one step: the tasks in submission
order (``schedule.submission_order``), each backward's successor on its
stage (to prefetch offloaded activations), and every micro-batch's loss
weight. ``LocalPipeline`` walks it with ``StageRuntime``s in one process:
the reference the Ray pipeline is tested against, and a way to check a
model's cut before spending a cluster on it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardps.worker.pipeline.offload import LocalSink, check_compress
from shardps.worker.pipeline.partition import scatter, split_model
from shardps.worker.pipeline.schedule import SCHEDULES, Task, stage_orders, submission_order
from shardps.worker.pipeline.stage import StageRuntime, check_checkpoint, seed_for

REDUCTIONS = ("mean", "sum")


def loss_reduction(loss_fn: Callable[..., torch.Tensor], reduction: str | None) -> str:
    """``reduction`` if given, else the loss module's own (``nn.CrossEntropyLoss().reduction``), else mean."""
    r = reduction or getattr(loss_fn, "reduction", None) or "mean"
    if r not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)} (the loss of a batch is the mean or "
                         f"the sum of its samples'), got {r!r}")
    return str(r)


@dataclass
class StepPlan:
    tasks: list[Task]
    next_backward: dict[tuple[int, int], int | None]  # (stage, micro-batch) -> the next backward's micro-batch
    weights: list[float]  # each micro-batch's loss weight
    sizes: list[int]


def plan_step(schedule: str, sizes: Sequence[int], num_stages: int, reduction: str) -> StepPlan:
    m, total = len(sizes), sum(sizes)
    nxt: dict[tuple[int, int], int | None] = {}
    for s, order in enumerate(stage_orders(schedule, m, num_stages)):
        backs = [t.microbatch for t in order if t.kind == "B"]
        for a, b in zip(backs, backs[1:] + [None]):
            nxt[(s, a)] = b
    weights = [n / total if reduction == "mean" else 1.0 for n in sizes]
    return StepPlan(submission_order(schedule, m, num_stages), nxt, weights, list(sizes))


def check_options(schedule: str, chunks: int, checkpoint: str, offload: str | None,
                  compress: str | Sequence[str] | None = None) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    check_checkpoint(checkpoint)
    if offload not in (None, "activations"):
        raise ValueError(f"offload must be None or 'activations', got {offload!r}")
    lossy = [c for c in check_compress(compress) if c in ("bf16", "fp16")]
    if lossy and not offload:
        raise ValueError(f"compress={lossy[0]!r} encodes offloaded activations: it needs offload='activations' "
                         f"('relu-mask' alone works without)")


class LocalPipeline:
    """Stages of ``model`` cut by ``balance``, run in this process under ``schedule`` with ``chunks``
    micro-batches per step. Same options and results as ``shardps.ray.Pipeline`` without servers."""

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, balance: Sequence[int] | None, chunks: int,
                 schedule: str = "gpipe", checkpoint: str = "except_last", offload: str | None = None,
                 compress: str | Sequence[str] | None = None, seed: int = 0) -> None:
        check_options(schedule, chunks, checkpoint, offload, compress)
        self.schedule, self.chunks, self.seed = schedule, chunks, seed
        modules = split_model(copy.deepcopy(model) if isinstance(model, nn.Module) else
                              [copy.deepcopy(m) for m in model], balance)  # the caller's model stays as it is
        self.sinks = [LocalSink() if offload else None for _ in modules]
        self.stages = [StageRuntime(mod, i, len(modules), checkpoint=checkpoint, seed=seed, offload=self.sinks[i],
                                    compress=check_compress(compress)) for i, mod in enumerate(modules)]
        self.step_count = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                   reduction: str | None = None) -> float:
        """Forward and backward of every micro-batch; the loss of the whole batch."""
        xs, ys = scatter(x, self.chunks, "batch"), scatter(y, self.chunks, "targets")
        plan = plan_step(self.schedule, [len(c) for c in xs], len(self.stages), loss_reduction(loss_fn, reduction))
        for st in self.stages:
            st.loss_fn = loss_fn
            st.begin_step(self.step_count, self.chunks)
        acts: dict[tuple[int, int], torch.Tensor] = {}
        grads: dict[tuple[int, int], torch.Tensor | None] = {}
        loss = 0.0
        last = len(self.stages) - 1
        for t in plan.tasks:
            st = self.stages[t.stage]
            if t.kind == "F":
                inp = xs[t.microbatch] if t.stage == 0 else acts.pop((t.stage - 1, t.microbatch))
                acts[(t.stage, t.microbatch)] = st.forward(t.microbatch, inp)
            else:
                acts.pop((t.stage, t.microbatch), None)
                nxt = plan.next_backward[(t.stage, t.microbatch)]
                if t.stage == last:
                    g, lv = st.backward(t.microbatch, target=ys[t.microbatch], weight=plan.weights[t.microbatch],
                                        next_mb=nxt)
                    loss += lv
                else:
                    g, _ = st.backward(t.microbatch, grad=grads.pop((t.stage + 1, t.microbatch)), next_mb=nxt)
                grads[(t.stage, t.microbatch)] = g
        self.step_count += 1
        return loss

    def gradients(self) -> dict[str, torch.Tensor]:
        return {n: g for st in self.stages for n, g in st.gradients().items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t for st in self.stages for n, t in st.state_dict().items()}

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for xc in scatter(x, min(self.chunks, len(x)), "batch"):
            for st in self.stages:
                xc = st.eval_forward(xc)
            outs.append(xc)
        return torch.cat(outs)


def reference_step(model: nn.Module | Sequence[nn.Module], balance: Sequence[int] | None, x: torch.Tensor,
                   y: torch.Tensor, loss_fn: Callable[..., torch.Tensor], chunks: int, *, seed: int = 0,
                   step: int = 0, reduction: str | None = None) -> float:
    """One process, no pipeline: the batch's loss and gradients (into ``.grad``) computed micro-batch by
    micro-batch with the pipeline's random streams (``seed_for``). Without randomness in the model this
    equals ``loss_fn(model(x), y).backward()`` up to summation order."""
    stages = split_model(model, balance)
    r = loss_reduction(loss_fn, reduction)
    xs, ys = scatter(x, chunks), scatter(y, chunks)
    total, loss = sum(len(c) for c in xs), 0.0
    for j, (xj, yj) in enumerate(zip(xs, ys)):
        h = xj
        for s, stage in enumerate(stages):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed_for(seed, step, j, s))
                h = stage(h)
        part = loss_fn(h, yj) * (len(xj) / total if r == "mean" else 1.0)
        torch.autograd.backward(part)
        loss += float(part.detach())
    return loss
