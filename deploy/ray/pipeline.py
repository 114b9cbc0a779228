"""``shardps.ray.Pipeline``: pipeline stages as Ray actors, their weights on the parameter servers.

The driver plans each step (``worker/pipeline/plan.py``) and walks it with
the one walker (``worker/pipeline/walk.py``) that ``LocalPipeline`` walks too:
here a stage's calls are actor calls that return object references at once
(``_ActorCalls``), so the walk submits every task of a step, in an order that
respects both the data dependencies and each stage's own order, and nothing
waits on the driver. Activations and their gradients travel as those
references: a stage's forward takes the previous stage's output reference and
Ray hands the tensor over when it exists. Each actor runs one task at a time,
in the order it received them, which is the schedule.

The actors (``stage_actor.py``) are shells over the Ray-free ``StageRuntime``
and ``StageWeights``: with ``servers`` every stage is a parameter-server
worker of its own parameters (worker id ``replica * stages + stage``); after
its last backward of a step it pushes its gradients and pulls its weights
under ``sync`` (asp/ssp: overlapping the next step, with weight stashing).

``offload="activations"`` sends what the stages save for backward to one
``OffloadStore`` actor, placed on a node offering the ``offload`` resource
when one does.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import remove_placement_group
from torch import nn

from shardps.deploy.ray.placement import DEFAULT_PLACEMENT_TIMEOUT_S, check_strategy, in_bundle, place
from shardps.deploy.ray.stage_actor import OffloadStore, RaySink, StageActor, StageOptions
from shardps.protos.security import Security
from shardps.protos.syncspec import SyncSpec
from shardps.worker.pipeline.partition import scatter, split_model
from shardps.worker.pipeline.plan import PipelineOptions, loss_reduction, plan_step
from shardps.worker.pipeline.schedule import Kind, Task
from shardps.worker.pipeline.walk import Mailbox, walk

__all__ = ["OffloadStore", "Pipeline", "PipelineError", "RaySink", "StageActor", "StageOptions"]

log = logging.getLogger("shardps.ray")


class PipelineError(RuntimeError):
    """A step failed: ``stage``, ``microbatch`` and ``kind`` ("forward"/"backward"/"sync") say where."""

    def __init__(self, message: str, stage: int | None = None, microbatch: int | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.stage, self.microbatch, self.kind = stage, microbatch, kind


@dataclass(frozen=True)
class _Submitted:
    """A task the driver submitted: on which replica, and the reference that is ready when it is done."""

    task: Task
    replica: int
    ref: Any


class _ActorCalls:
    """A stage actor as the walker's ``StageCalls``: each call submits the task and returns its result's
    object reference at once; every submission is recorded in ``submitted`` (to find a failed task)."""

    def __init__(self, actor: Any, stage: int, replica: int, submitted: list[_Submitted]) -> None:
        self.actor, self.stage, self.replica, self.submitted = actor, stage, replica, submitted

    def forward(self, mb: int, x: Any, /) -> Any:
        ref = self.actor.forward.remote(mb, x)
        self.submitted.append(_Submitted(Task(mb, self.stage, Kind.FORWARD), self.replica, ref))
        return ref

    def backward(self, mb: int, grad: Any, target: Any, weight: float, next_mb: int | None, /) -> tuple[Any, Any]:
        g, loss = self.actor.backward.options(num_returns=2).remote(mb, grad, target, weight, next_mb)
        self.submitted.append(_Submitted(Task(mb, self.stage, Kind.BACKWARD), self.replica, g))
        return g, loss


class Pipeline:
    """``model`` cut into stages by ``balance``, each stage a Ray actor; see the module docstring.

    ``replicas`` pipelines train data-parallel through ``servers`` (the batch
    is split between them). ``stage_resources``: extra resources of every
    stage's bundle; ``use_gpu``: one GPU per stage. Actors start at the first
    step, after the batch and the model's stages have been checked.
    """

    stage_actor: type[StageActor] = StageActor  # what each stage's actor runs (a subclass may add to it)

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, balance: Sequence[int] | None, chunks: int,
                 schedule: str = "gpipe", checkpoint: str = "except_last", offload: str | None = None,
                 compress: str | Sequence[str] | None = None, strategy: str = "SPREAD",
                 stage_resources: dict[str, float] | None = None, servers: Any = None,
                 optimizer: Any = None, sync: str = "bsp", replicas: int = 1, use_gpu: bool = False,
                 num_cpus: float = 1.0, seed: int = 0, weight_delay: int = 1,
                 placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT_S, step_timeout: float = 600.0,
                 security: Security | None = None, offload_resources: dict[str, float] | None = None) -> None:
        self.options = PipelineOptions(schedule, chunks, checkpoint, offload, compress)
        self.stage_modules = split_model(model, balance)
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.schedule, self.chunks, self.checkpoint, self.offload = schedule, chunks, checkpoint, offload
        self.compress = self.options.encodings
        self.strategy = check_strategy(strategy)
        self.sync_spec = SyncSpec.parse(sync)
        self.sync = str(self.sync_spec)
        self.servers = servers
        self.addresses = list(servers.addresses if hasattr(servers, "addresses") else servers) if servers else None
        self.replicas, self.use_gpu, self.num_cpus, self.seed = replicas, use_gpu, num_cpus, seed
        self.weight_delay = weight_delay
        self.stage_resources = dict(stage_resources or {})
        self.offload_resources = offload_resources
        self.optimizer, self.security = optimizer, security
        self.placement_timeout, self.step_timeout = placement_timeout, step_timeout
        self.stages: list[list[Any]] = []  # [replica][stage]
        self.store: Any = None
        self.placement_group: Any = None
        self.step_count = 0
        self._t0 = 0.0
        self._closed = False

    @property
    def num_stages(self) -> int:
        return len(self.stage_modules)

    # -- start ---------------------------------------------------------------

    def _dry_run(self, x: torch.Tensor) -> None:
        """Every stage but the last returns one tensor: checked on the meta device, before any actor starts."""
        h = x[:1].to("meta")
        for i, mod in enumerate(self.stage_modules[:-1]):
            try:
                h = copy.deepcopy(mod).to("meta")(h)
            except (NotImplementedError, RuntimeError):  # an op without a meta kernel: the stage says so later
                return
            if not isinstance(h, torch.Tensor):
                raise TypeError(f"stage {i} returned {type(h).__name__}, not a tensor: every stage but the last "
                                f"must return one tensor for the next")

    def _start(self) -> None:
        d, r = self.num_stages, self.replicas
        bundle = {"CPU": float(self.num_cpus), **self.stage_resources}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        self.placement_group = place([dict(bundle) for _ in range(d * r)], self.strategy,
                                     timeout=self.placement_timeout, what=f"pipeline stages ({r} x {d})")
        try:
            if self.offload:
                res = self.offload_resources
                if res is None:
                    offers = any("offload" in n["Resources"] for n in ray.nodes() if n["Alive"])
                    res = {"offload": 0.001} if offers else {}
                self.store = ray.remote(OffloadStore).options(num_cpus=0, resources=res).remote()
            cls = ray.remote(self.stage_actor)
            opts = StageOptions(checkpoint=self.checkpoint, seed=self.seed, compress=self.compress, store=self.store,
                                use_gpu=self.use_gpu, num_cpus=self.num_cpus, servers=tuple(self.addresses or ()),
                                backups=tuple(getattr(self.servers, "backup_addresses", []) or ()), replicas=r,
                                sync=self.sync_spec, optimizer=self.optimizer, security=self.security,
                                weight_delay=self.weight_delay)
            for rep in range(r):
                row = []
                for s, mod in enumerate(self.stage_modules):
                    row.append(cls.options(num_cpus=self.num_cpus, num_gpus=1 if self.use_gpu else 0,
                                           resources=self.stage_resources,
                                           **in_bundle(self.placement_group, rep * d + s)).remote(mod, s, d, rep, opts))
                self.stages.append(row)
            self.infos = ray.get([a.info.remote() for row in self.stages for a in row], timeout=600)
            if self.store is not None:
                self.store_info = ray.get(self.store.info.remote(), timeout=120)
        except BaseException:
            self.close()
            raise

    @property
    def node_ids(self) -> list[list[str]]:
        """The node of every stage: ``node_ids[replica][stage]``."""
        d = self.num_stages
        return [[i["node_id"] for i in self.infos[r * d:(r + 1) * d]] for r in range(self.replicas)]

    # -- a step --------------------------------------------------------------

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                   reduction: str | None = None) -> float:
        """Forward and backward of every micro-batch under the schedule, then (with servers) each stage
        pushes its gradients and pulls its weights. The loss of the whole batch."""
        if self._closed:
            raise RuntimeError("this pipeline was closed")
        red = loss_reduction(loss_fn, reduction)
        xr = scatter(x, self.replicas, "batch") if self.replicas > 1 else [x]
        yr = scatter(y, self.replicas, "targets") if self.replicas > 1 else [y]
        parts = [(scatter(a, self.chunks, "batch"), scatter(b, self.chunks, "targets")) for a, b in zip(xr, yr)]
        if not self.stages:
            self._dry_run(x)
            self._start()
        total = len(x)
        d = self.num_stages
        self._t0 = time.time()
        for row in self.stages:
            for a in row:
                a.begin_step.remote(self.step_count, self.chunks, loss_fn)
        order: list[_Submitted] = []  # every task, in submission order, with its result's reference
        losses: list[Any] = []
        for rep, (xs, ys) in enumerate(parts):
            sizes = [len(c) for c in xs]
            # The servers average the replicas' gradients: weigh each so that the average is the gradient
            # of the whole batch (R * its share of the samples; the loss is divided by R again below).
            share = self.replicas * (sum(sizes) / total if red == "mean" else 1.0)
            plan = plan_step(self.schedule, sizes, d, red, scale=share)
            calls = {s: _ActorCalls(self.stages[rep][s], s, rep, order) for s in range(d)}
            losses += walk(plan, calls, Mailbox[Any](), xs, ys)
        syncs = [(s, rep, self.stages[rep][s].sync.remote()) for rep in range(self.replicas) for s in range(d)]
        refs = [o.ref for o in order] + losses + [ref for _, _, ref in syncs]
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=self.step_timeout)
        failed = self._failure(order, syncs) if pending or not done else None
        if failed is None:
            try:
                loss = sum(ray.get(losses, timeout=60)) / self.replicas
                ray.get([ref for _, _, ref in syncs], timeout=60)
            except RayError:
                failed = self._failure(order, syncs)
        if failed is not None:
            raise failed
        if pending:
            late = set(pending)
            first = next((o for o in order if o.ref in late), None)
            if first is None:  # every task is done: a sync (a push or pull) is what is late
                s, rep, _ = next(o for o in syncs if o[2] in late)
                raise PipelineError(f"step {self.step_count}: stage {s} (replica {rep}) did not sync with the "
                                    f"servers within {self.step_timeout:.0f}s", s, None, "sync")
            t = first.task
            raise PipelineError(f"step {self.step_count}: the {t.kind.word} of micro-batch {t.microbatch} on "
                                f"stage {t.stage} (replica {first.replica}) did not finish within "
                                f"{self.step_timeout:.0f}s", t.stage, t.microbatch, t.kind.word)
        self.step_count += 1
        return float(loss)

    def _failure(self, order: list[_Submitted],
                 syncs: list[tuple[int, int, Any]]) -> PipelineError | None:
        """The first task, in submission order, that failed: which stage, which micro-batch, why.

        A stage that died is named exactly; its micro-batch is the first whose result did not come
        back: the one it was running, or an earlier one when the process died before it had sent that
        one's result (Ray sends a task's reply after the task ends, so an abrupt death can lose the
        replies still on their way: under load, those of several micro-batches)."""
        for o in order:
            t, rep, ref, what = o.task, o.replica, o.ref, o.task.kind.word
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                ray.get(ref, timeout=0)
            except (RayActorError, RayError, GetTimeoutError) as e:
                cause = type(e).__name__ if isinstance(e, RayActorError) else str(e).splitlines()[0]
                dead = isinstance(e, RayActorError) or "ActorDiedError" in str(e)
                where = (f"died, the {what} of micro-batch {t.microbatch} the first result lost" if dead
                         else f"failed in the {what} of micro-batch {t.microbatch}")
                return PipelineError(
                    f"step {self.step_count}: stage {t.stage} (replica {rep}) {where} ({cause})"
                    + ("; rebuild the pipeline: a new Pipeline with the same servers starts from their weights"
                       if dead and self.servers else ""), t.stage, t.microbatch, what)
        for s, rep, ref in syncs:
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref, timeout=0)
            except (RayError, GetTimeoutError) as e:
                return PipelineError(f"step {self.step_count}: stage {s} (replica {rep}) failed to sync with the "
                                     f"servers: {str(e).splitlines()[0]}", s, None, "sync")
        return None

    # -- results ---------------------------------------------------------------

    def _all(self, method: str, replica: int = 0) -> list[Any]:
        if not self.stages:
            raise RuntimeError("no step has run yet: the stages start with the first train_step")
        return ray.get([getattr(a, method).remote() for a in self.stages[replica]], timeout=300)

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients by name: of the whole batch (the mean over the replicas' gradients,
        each weighted by its share, as the servers apply it)."""
        out: dict[str, torch.Tensor] = {}
        for rep in range(self.replicas):
            for part in self._all("gradients", rep):
                for n, g in part.items():
                    out[n] = g / self.replicas if n not in out else out[n] + g / self.replicas
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights every stage computes with now (after any pull in flight)."""
        return {n: t for part in self._all("state_dict") for n, t in part.items()}

    def timeline(self) -> dict[int, list[tuple[str, int, float, float]]]:
        """Replica 0's stages' busy intervals of the last step, in seconds from its start:
        ``{stage: [(kind, micro-batch, start, end)]}``; kinds F, B, R (recomputation) and S (sync)."""
        parts = self._all("timeline")
        return {s: sorted(((k, mb, a - self._t0, b - self._t0) for k, mb, a, b in part), key=lambda i: i[2])
                for s, part in enumerate(parts)}

    def versions(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """Per stage of replica 0: (step, micro-batch, weight version of its forward, of its backward)."""
        return dict(enumerate(self._all("versions")))

    def offload_stats(self) -> dict[int, dict[str, int]]:
        return dict(enumerate(self._all("offload_stats")))

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """A forward of ``x`` (eval mode, no gradients) through replica 0's stages, micro-batch by micro-batch."""
        if not self.stages:
            self._dry_run(x)
            self._start()
        outs = []
        for xc in scatter(x, min(self.chunks, len(x)), "batch"):
            ref: Any = xc
            for a in self.stages[0]:
                ref = a.eval_forward.remote(ref)
            outs.append(ref)
        return torch.cat(ray.get(outs, timeout=self.step_timeout))

    def close(self) -> None:
        """Free the stage actors, the offload store and the placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        actors = [a for row in self.stages for a in row]
        closing = [a.close.remote() for a in actors]  # pulls in flight land; clients leave
        ray.wait(closing, num_returns=len(closing), timeout=60)
        for ref in closing:
            try:
                ray.get(ref, timeout=0)
            except (RayError, GetTimeoutError) as e:
                log.warning("closing a pipeline stage: %s", str(e).splitlines()[0])
        for a in actors + ([self.store] if self.store is not None else []):
            ray.kill(a, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
