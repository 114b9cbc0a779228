"""``shardps.ray.Pipeline``: pipeline stages as Ray actors, their weights on the parameter servers.

The driver walks the schedule (``worker/pipeline``: pure, tested as tables)
and submits each task to its stage's actor in an order that respects both
the data dependencies and each stage's own order. Activations and their
gradients travel as Ray object references: a stage's forward takes the
previous stage's output reference and Ray hands the tensor over when it
exists, so nothing waits on the driver. Each actor runs one task at a time,
in the order it received them, which is the schedule.

With ``servers`` every stage is a parameter-server worker of its own
parameters (worker id ``replica * stages + stage``): after its last backward
of a step it pushes its gradients and pulls its weights under ``sync``.
Under asp and ssp the pull overlaps the next step: its first
``weight_delay`` micro-batches run on the weights they have, the rest on the
new ones, and each backward on its forward's (weight stashing).

``offload="activations"`` sends what the stages save for backward to one
``OffloadStore`` actor, placed on a node offering the ``offload`` resource
when one does.

(Over 400 lines: the three actors and the driver that dispatches to them
are one protocol, each side's calls beside the other's; the schedules,
stage runtime and offload codecs they use live in worker/pipeline/.)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import remove_placement_group
from torch import nn

from shardps.deploy.ray.placement import (
    DEFAULT_PLACEMENT_TIMEOUT_S,
    actor_logging,
    check_strategy,
    in_bundle,
    place,
)
from shardps.protos.security import Security
from shardps.worker.pipeline.local import check_options, loss_reduction, plan_step
from shardps.worker.pipeline.offload import check_compress
from shardps.worker.pipeline.partition import scatter, split_model
from shardps.worker.pipeline.schedule import Task

log = logging.getLogger("shardps.ray")


class PipelineError(RuntimeError):
    """A step failed: ``stage``, ``microbatch`` and ``kind`` ("forward"/"backward"/"sync") say where."""

    def __init__(self, message: str, stage: int | None = None, microbatch: int | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.stage, self.microbatch, self.kind = stage, microbatch, kind


class OffloadStore:
    """Holds offloaded activations between a forward and its backward (CPU memory of its node)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.bytes = 0
        self.peak_bytes = 0

    @staticmethod
    def _size(value: Any) -> int:
        t = value[0] if isinstance(value, tuple) else value
        return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.bytes += self._size(value)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def get(self, key: str) -> Any:
        return self.data[key]

    def drop(self, keys: list[str]) -> None:
        for k in keys:
            v = self.data.pop(k, None)
            if v is not None:
                self.bytes -= self._size(v)

    def info(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "bytes": self.bytes,
                "peak_bytes": self.peak_bytes, "tensors": len(self.data)}


class RaySink:
    """A stage's side of the offload store: puts go out at once, backwards prefetch what they need."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._fetching: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.store.put.remote(key, value)  # an actor runs one caller's calls in order: a get comes after

    def prefetch(self, keys: Iterable[str]) -> None:
        for k in keys:
            if k not in self._fetching:
                self._fetching[k] = self.store.get.remote(k)

    def get(self, key: str) -> Any:
        ref = self._fetching.pop(key, None) or self.store.get.remote(key)
        return ray.get(ref, timeout=300)

    def drop(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for k in keys:
            self._fetching.pop(k, None)
        self.store.drop.remote(keys)


class StageActor:
    """One stage of one pipeline replica: a ``StageRuntime``, and with servers a worker of its parameters."""

    def __init__(self, module: nn.Module, index: int, num_stages: int, replica: int, opts: dict[str, Any]) -> None:
        from shardps.worker.pipeline.stage import StageRuntime

        actor_logging()
        self.index, self.num_stages, self.replica = index, num_stages, replica
        device = torch.device("cuda") if opts.get("use_gpu") and torch.cuda.is_available() else torch.device("cpu")
        if not opts.get("use_gpu"):
            torch.set_num_threads(max(1, int(opts.get("num_cpus", 1))))
        sink = RaySink(opts["store"]) if opts.get("store") is not None else None
        self.rt = StageRuntime(module, index, num_stages, checkpoint=opts["checkpoint"], seed=opts["seed"],
                               offload=sink, compress=tuple(opts.get("compress") or ()), device=device,
                               on_forward=self._fault if opts.get("die_at") else None, key_prefix=f"r{replica}")
        self.die_at = opts.get("die_at")  # (step, microbatch): tests kill the actor there
        self.sync_mode = opts.get("sync", "bsp")
        self.stash = self.sync_mode != "bsp" and not self.sync_mode.startswith("every")
        self.weight_delay = int(opts.get("weight_delay", 0)) if self.stash else 0
        self.client: Any = None
        self.opt: Any = None
        self._sync_thread: threading.Thread | None = None
        self._sync_error: BaseException | None = None
        self._synced: dict[str, torch.Tensor] | None = None
        self.sync_intervals: list[tuple[float, float]] = []
        if opts.get("servers"):
            self._join(opts)

    def _join(self, opts: dict[str, Any]) -> None:
        import shardps

        d, r = self.num_stages, self.replica
        self.client = shardps.connect(opts["servers"], worker_id=r * d + self.index,
                                      num_workers=opts["replicas"] * d, backups=opts.get("backups") or None,
                                      security=opts.get("security"))
        # The pull target: the masters. Forwards run on them (bsp) or on copies of each version (asp/ssp).
        self.masters = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.rt.params.items()}
        self.opt = shardps.DistributedOptimizer(list(self.masters.items()), self.client,
                                                optimizer=opts.get("optimizer"), sync=self.sync_mode,
                                                provides_values=(r == 0))
        self._install_masters()

    def _install_masters(self) -> None:
        if self.stash:
            self.rt.install({n: t.detach().clone() for n, t in self.masters.items()})
        else:
            self.rt.install(self.masters)

    def _fault(self, step: int, mb: int) -> None:
        if (step, mb) == tuple(self.die_at):  # type: ignore[arg-type]
            os.kill(os.getpid(), 9)

    def info(self) -> dict[str, Any]:
        return {"stage": self.index, "replica": self.replica, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "device": str(self.rt.device)}

    def begin_step(self, step: int, chunks: int, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        self.rt.begin_step(step, chunks)
        self.rt.loss_fn = loss_fn
        self.sync_intervals = []

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        if mb >= min(self.weight_delay, self.rt.chunks - 1):  # at least the last micro-batch waits
            self._wait_sync()
        return self.rt.forward(mb, x)

    def backward(self, mb: int, grad: torch.Tensor | None, target: torch.Tensor | None, weight: float,
                 next_mb: int | None) -> tuple[torch.Tensor | None, float]:
        return self.rt.backward(mb, grad, target, weight, next_mb)

    def sync(self) -> int:
        """Push this step's gradients, pull the weights (bsp: now; asp/ssp: in the background)."""
        if self.opt is None:
            return self.rt.version
        self._wait_sync()  # a pull still in flight (every forward of the step ran before it): land it first
        grads = self.rt._grads
        for n, t in self.masters.items():
            g = grads.get(n)
            t.grad = None if g is None else g.to(t.device)
        if self.stash:
            self._sync_thread = threading.Thread(target=self._sync_now, name="stage-sync", daemon=True)
            self._sync_thread.start()
            return self.rt.version
        self._sync_now()
        if self._sync_error is not None:
            err, self._sync_error = self._sync_error, None
            raise err
        self._install_masters()
        return self.rt.version

    def _sync_now(self) -> None:
        t0 = time.time()
        try:
            assert self.opt is not None
            self.opt.step()
            self.opt.zero_grad()
        except BaseException as e:  # noqa: BLE001 - raised again by the next forward (_wait_sync)
            self._sync_error = e
        self.sync_intervals.append((t0, time.time()))

    def _wait_sync(self) -> None:
        if self._sync_thread is None:
            return
        self._sync_thread.join()
        self._sync_thread = None
        if self._sync_error is not None:
            err, self._sync_error = self._sync_error, None
            raise err
        self._install_masters()

    def flush(self) -> int:
        """Wait for a pull still in flight; the version forwards run on now."""
        self._wait_sync()
        return self.rt.version

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.rt.gradients()

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._wait_sync()
        return self.rt.state_dict()

    def timeline(self) -> list[tuple[str, int, float, float]]:
        out = [(i.kind, i.microbatch, i.start, i.end) for i in self.rt.timeline]
        return out + [("S", -1, a, b) for a, b in self.sync_intervals]

    def versions(self) -> list[tuple[int, int, int, int]]:
        return list(self.rt.versions)

    def offload_stats(self) -> dict[str, int]:
        s = self.rt.offloader.stats
        return {"peak_held_bytes": s.peak_held_bytes, "stored_total": s.stored_total, "raw_total": s.raw_total,
                "peak_stored_bytes": s.peak_stored_bytes}

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._wait_sync()
        return self.rt.eval_forward(x)

    def close(self) -> None:
        try:
            self._wait_sync()
        finally:
            if self.client is not None:
                self.client.close()  # says goodbye, even after a failed sync


def _task_name(t: Task) -> str:
    return "forward" if t.kind == "F" else "backward"


class Pipeline:
    """``model`` cut into stages by ``balance``, each stage a Ray actor; see the module docstring.

    ``replicas`` pipelines train data-parallel through ``servers`` (the batch
    is split between them). ``stage_resources``: extra resources of every
    stage's bundle; ``use_gpu``: one GPU per stage. Actors start at the first
    step, after the batch and the model's stages have been checked.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, balance: Sequence[int] | None, chunks: int,
                 schedule: str = "gpipe", checkpoint: str = "except_last", offload: str | None = None,
                 compress: str | Sequence[str] | None = None, strategy: str = "SPREAD",
                 stage_resources: dict[str, float] | None = None, servers: Any = None,
                 optimizer: Any = None, sync: str = "bsp", replicas: int = 1, use_gpu: bool = False,
                 num_cpus: float = 1.0, seed: int = 0, weight_delay: int = 1,
                 placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT_S, step_timeout: float = 600.0,
                 security: Security | None = None, offload_resources: dict[str, float] | None = None,
                 _die_at: dict[int, tuple[int, int]] | None = None) -> None:
        from shardps.protos.syncspec import SyncSpec

        check_options(schedule, chunks, checkpoint, offload, compress)
        self.stage_modules = split_model(model, balance)
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.schedule, self.chunks, self.checkpoint, self.offload = schedule, chunks, checkpoint, offload
        self.compress = check_compress(compress)
        self.strategy = check_strategy(strategy)
        self.sync = str(SyncSpec.parse(sync))
        self.servers = servers
        self.addresses = list(servers.addresses if hasattr(servers, "addresses") else servers) if servers else None
        self.replicas, self.use_gpu, self.num_cpus, self.seed = replicas, use_gpu, num_cpus, seed
        self.weight_delay = weight_delay
        self.stage_resources = dict(stage_resources or {})
        self.offload_resources = offload_resources
        self.optimizer, self.security = optimizer, security
        self.placement_timeout, self.step_timeout = placement_timeout, step_timeout
        self._die_at = _die_at or {}
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
        import copy

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
            cls = ray.remote(StageActor)
            backups = list(getattr(self.servers, "backup_addresses", []) or [])
            for rep in range(r):
                row = []
                for s, mod in enumerate(self.stage_modules):
                    opts = {"checkpoint": self.checkpoint, "seed": self.seed, "compress": self.compress,
                            "store": self.store, "use_gpu": self.use_gpu, "num_cpus": self.num_cpus,
                            "servers": self.addresses, "backups": backups, "replicas": r, "sync": self.sync,
                            "optimizer": self.optimizer, "security": self.security,
                            "weight_delay": self.weight_delay, "die_at": self._die_at.get(s) if rep == 0 else None}
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
        d, last = self.num_stages, self.num_stages - 1
        self._t0 = time.time()
        for row in self.stages:
            for a in row:
                a.begin_step.remote(self.step_count, self.chunks, loss_fn)
        order: list[tuple[Task, int, Any]] = []  # (task, replica, its output reference)
        losses = []
        for rep, (xs, ys) in enumerate(parts):
            sizes = [len(c) for c in xs]
            plan = plan_step(self.schedule, sizes, d, red)
            # The servers average the replicas' gradients: weigh each so that the average is the gradient
            # of the whole batch (R * its share of the samples; the loss is divided by R again below).
            share = self.replicas * (sum(sizes) / total if red == "mean" else 1.0)
            acts: dict[tuple[int, int], Any] = {}
            grads: dict[tuple[int, int], Any] = {}
            for t in plan.tasks:
                actor = self.stages[rep][t.stage]
                if t.kind == "F":
                    inp = xs[t.microbatch] if t.stage == 0 else acts[(t.stage - 1, t.microbatch)]
                    ref = acts[(t.stage, t.microbatch)] = actor.forward.remote(t.microbatch, inp)
                else:
                    nxt = plan.next_backward[(t.stage, t.microbatch)]
                    call = actor.backward.options(num_returns=2)
                    if t.stage == last:
                        g, lv = call.remote(t.microbatch, None, ys[t.microbatch], plan.weights[t.microbatch] * share,
                                            nxt)
                        losses.append(lv)
                    else:
                        g, lv = call.remote(t.microbatch, grads[(t.stage + 1, t.microbatch)], None, 1.0, nxt)
                    ref = grads[(t.stage, t.microbatch)] = g
                order.append((t, rep, ref))
        syncs = [(s, rep, self.stages[rep][s].sync.remote()) for rep in range(self.replicas) for s in range(d)]
        refs = [ref for _, _, ref in order] + losses + [ref for _, _, ref in syncs]
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
            first = next((o for o in order if o[2] in late), None)
            if first is None:  # every task is done: a sync (a push or pull) is what is late
                s, rep, _ = next(o for o in syncs if o[2] in late)
                raise PipelineError(f"step {self.step_count}: stage {s} (replica {rep}) did not sync with the "
                                    f"servers within {self.step_timeout:.0f}s", s, None, "sync")
            t, rep, _ = first
            raise PipelineError(f"step {self.step_count}: the {_task_name(t)} of micro-batch {t.microbatch} on "
                                f"stage {t.stage} (replica {rep}) did not finish within {self.step_timeout:.0f}s",
                                t.stage, t.microbatch, _task_name(t))
        self.step_count += 1
        return float(loss)

    def _failure(self, order: list[tuple[Task, int, Any]],
                 syncs: list[tuple[int, int, Any]]) -> PipelineError | None:
        """The first task, in submission order, that failed: which stage, which micro-batch, why.

        A stage that died is named exactly; its micro-batch is the first whose result did not come
        back: the one it was running, or an earlier one when the process died before it had sent that
        one's result (Ray sends a task's reply after the task ends, so an abrupt death can lose the
        replies still on their way: under load, those of several micro-batches)."""
        for t, rep, ref in order:
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                ray.get(ref, timeout=0)
            except (RayActorError, RayError, GetTimeoutError) as e:
                cause = type(e).__name__ if isinstance(e, RayActorError) else str(e).splitlines()[0]
                dead = isinstance(e, RayActorError) or "ActorDiedError" in str(e)
                where = (f"died, the {_task_name(t)} of micro-batch {t.microbatch} the first result lost" if dead
                         else f"failed in the {_task_name(t)} of micro-batch {t.microbatch}")
                return PipelineError(
                    f"step {self.step_count}: stage {t.stage} (replica {rep}) {where} ({cause})"
                    + ("; rebuild the pipeline: a new Pipeline with the same servers starts from their weights"
                       if dead and self.servers else ""), t.stage, t.microbatch, _task_name(t))
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
