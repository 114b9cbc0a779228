"""``LocalPipeline``: all stages in this process, one task at a time; and ``reference_step``.

A step is planned (``plan.plan_step``) and walked (``walk.walk``) with the
stages' ``StageRuntime``s as the calls and a ``Mailbox`` as the link: the same
plan and walker the Ray pipeline drives. It is the reference the Ray pipeline
is tested against, and a way to check a model's cut before spending a cluster
on it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from shardps.worker.pipeline.offload import LocalSink
from shardps.worker.pipeline.partition import scatter, split_model, stage_ties
from shardps.worker.pipeline.plan import PipelineOptions, loss_reduction, plan_step
from shardps.worker.pipeline.stage import StageRuntime, seed_for
from shardps.worker.pipeline.walk import Mailbox, walk, walk_eval


class LocalPipeline:
    """Stages of ``model`` cut by ``balance``, run in this process under ``schedule`` with ``chunks``
    micro-batches per step. Same options and results as ``shardps.ray.Pipeline`` without servers."""

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, balance: Sequence[int] | None, chunks: int,
                 schedule: str = "gpipe", checkpoint: str = "except_last", offload: str | None = None,
                 compress: str | Sequence[str] | None = None, seed: int = 0) -> None:
        self.options = PipelineOptions(schedule, chunks, checkpoint, offload, compress)
        self.schedule, self.chunks, self.seed = schedule, chunks, seed
        # The caller's model stays as it is; one copy of all stages, so that a weight they share stays shared.
        modules = split_model(copy.deepcopy(model) if isinstance(model, nn.Module) else copy.deepcopy(list(model)),
                              balance)
        self.sinks = [LocalSink() if offload else None for _ in modules]
        self.ties = ties = stage_ties(modules)  # a weight tied across stages: one name in every stage using it
        self.stages = [StageRuntime(mod, i, len(modules), checkpoint=checkpoint, seed=seed, offload=self.sinks[i],
                                    compress=self.options.encodings, aliases=ties.aliases[i])
                       for i, mod in enumerate(modules)]
        self.step_count = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                   reduction: str | None = None) -> float:
        """Forward and backward of every micro-batch; the loss of the whole batch."""
        xs, ys = scatter(x, self.chunks, "batch"), scatter(y, self.chunks, "targets")
        plan = plan_step(self.schedule, [len(c) for c in xs], len(self.stages), loss_reduction(loss_fn, reduction))
        for st in self.stages:
            st.loss_fn = loss_fn
            st.begin_step(self.step_count, self.chunks)
        losses = walk(plan, dict(enumerate(self.stages)), Mailbox[torch.Tensor](), xs, ys)
        loss = 0.0
        for lv in losses:  # in the order the last stage's backwards ran
            loss += lv
        for st in self.stages:  # extra loss terms (MoE balancing losses; none without servers)
            for lv in st.aux_losses:
                loss += lv
        self.step_count += 1
        return loss

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients by name (CPU copies); a weight tied across stages: the sum of theirs."""
        out: dict[str, torch.Tensor] = {}
        for st in self.stages:
            for n, g in st.gradients().items():
                out[n] = out[n] + g if n in out else g
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights by name (CPU copies), a weight tied across stages under each of its names
        (as the whole model's state dict has it)."""
        return self.ties.under_every_name({n: t for st in self.stages for n, t in st.state_dict().items()})

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """A forward of ``x`` in eval mode (no gradients), micro-batch by micro-batch."""
        xs = scatter(x, min(self.chunks, len(x)), "batch")
        return torch.cat(walk_eval(len(self.stages), len(xs), dict(enumerate(self.stages)),
                                   Mailbox[torch.Tensor](), xs))


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
