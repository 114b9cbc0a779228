"""What runs inside a pipeline's Ray actors: a stage (``StageActor``) and the offload store.

``StageActor`` is a shell: the stage's compute is a ``StageRuntime`` and its
parameter-server side a ``StageWeights`` (both worker/pipeline/, no Ray); the
actor builds them from ``StageOptions`` and connects to the servers. The
driver calls it once per step (``run_step``): the actor walks its own part of
the plan (``walk.walk`` with this stage alone), receiving activations from the
stage before and gradients from the stage after over the pipeline's process
group (``GroupLink``, joined by ``connect``), then pushes and pulls its
weights. A failure ends the step on every stage (``StageFailed`` with what the
stage saw). ``OffloadStore`` holds offloaded activations; ``RaySink`` is a
stage's side of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from torch import nn

from shardps.deploy.ray.placement import actor_logging
from shardps.protos.security import Security
from shardps.protos.syncspec import SyncSpec
from shardps.worker.groups import GroupSpec, Rendezvous, connect_store, open_group
from shardps.worker.pipeline.failure import Outcome, StageFailed
from shardps.worker.pipeline.link import GroupLink, LinkError
from shardps.worker.pipeline.plan import StepPlan
from shardps.worker.pipeline.schedule import Kind, Task
from shardps.worker.pipeline.stage import StageRuntime
from shardps.worker.pipeline.walk import walk, walk_eval
from shardps.worker.pipeline.weights import StageWeights, Stepper


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


@dataclass(frozen=True)
class StageOptions:
    """How a stage actor runs, the same for every stage of a pipeline (built by ``Pipeline``, pickled to
    the actors). ``servers``: the shards' addresses (empty: no servers, the stage only computes);
    ``store``: the pipeline's ``OffloadStore`` actor (None: no offload); ``optimizer``: the spec, or a
    function of (name, tensor), the servers apply."""

    checkpoint: str = "except_last"
    seed: int = 0
    compress: tuple[str, ...] = ()
    store: Any = None
    use_gpu: bool = False
    num_cpus: float = 1.0
    servers: tuple[str, ...] = ()
    backups: tuple[str, ...] = ()
    replicas: int = 1
    sync: SyncSpec = field(default_factory=lambda: SyncSpec("bsp"))
    optimizer: Any = None
    security: Security | None = None
    weight_delay: int = 1


class StageActor:
    """Stage ``index`` of ``num_stages`` of pipeline replica ``replica``: runs its part of each step of
    ``module`` (``run_step``, one call a step); with servers it is parameter-server worker ``replica *
    num_stages + index`` of its own parameters. ``forward`` and ``backward`` are what its walk calls per
    task: subclasses may add to them (the fault tests do)."""

    def __init__(self, module: nn.Module, index: int, num_stages: int, replica: int, opts: StageOptions) -> None:
        actor_logging()
        self.index, self.num_stages, self.replica = index, num_stages, replica
        gpu = opts.use_gpu and torch.cuda.is_available()
        device = torch.device("cuda") if gpu else torch.device("cpu")
        self.link: GroupLink | None = None
        self._task: Task | None = None  # the task running now (named when it fails)
        if not opts.use_gpu:
            torch.set_num_threads(max(1, int(opts.num_cpus)))
        sink = RaySink(opts.store) if opts.store is not None else None
        self.rt = StageRuntime(module, index, num_stages, checkpoint=opts.checkpoint, seed=opts.seed,
                               offload=sink, compress=opts.compress, device=device, key_prefix=f"r{replica}")
        self.client: Any = None
        self.weights = StageWeights(self.rt, opts.sync, opts.weight_delay,
                                    self._stepper(opts) if opts.servers else None)

    def _stepper(self, opts: StageOptions) -> Callable[[list[tuple[str, torch.Tensor]]], Stepper]:
        def make(masters: list[tuple[str, torch.Tensor]]) -> Stepper:
            from shardps.worker.client import connect
            from shardps.worker.optimizer import DistributedOptimizer

            d, r = self.num_stages, self.replica
            self.client = connect(list(opts.servers), worker_id=r * d + self.index, num_workers=opts.replicas * d,
                                  backups=list(opts.backups) or None, security=opts.security)
            return DistributedOptimizer(masters, self.client, optimizer=opts.optimizer, sync=str(opts.sync),
                                        provides_values=(r == 0))
        return make

    def info(self) -> dict[str, Any]:
        return {"stage": self.index, "replica": self.replica, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "device": str(self.rt.device)}

    def connect(self, rendezvous: Rendezvous, name: str, timeout: float) -> None:
        """Join the pipeline's process group ``name`` (a new one after a failure: the old is dropped) as
        rank ``index``, at ``rendezvous``; every stage of the replica calls this at once. gloo, or nccl
        when the stage computes on a GPU."""
        if self.link is not None:
            self.link.close()
            self.link = None
        gpu = self.rt.device.type == "cuda"
        spec = GroupSpec(name, self.index, self.num_stages, "nccl" if gpu else "gloo", timeout)
        group = open_group(connect_store(rendezvous, timeout), spec, ray.util.get_node_ip_address())
        self.link = GroupLink(group, self.index, self.num_stages, self.rt.device if gpu else None)

    def begin_step(self, step: int, chunks: int, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        self.rt.begin_step(step, chunks)
        self.rt.loss_fn = loss_fn
        self.weights.begin_step()

    def run_step(self, step: int, plan: StepPlan, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable[..., torch.Tensor] | None,
                 timeout: float) -> list[float]:
        """This stage's part of step ``step``: its tasks of ``plan`` in its own order (stage 0 reads
        ``inputs``, the last stage ``targets``), every wait within ``timeout`` seconds; then the push and
        pull of its gradients. The last stage's weighted losses (empty on the others). Raises
        ``StageFailed``; a failure in the walk closes this stage's group, so that its neighbours end too."""
        link = self._link()
        self.begin_step(step, plan.chunks, loss_fn)
        self._task = None
        try:
            link.start(step, timeout, plan.orders)
            losses: list[float] = walk(plan, {self.index: _Tracked(self)}, link, inputs, targets)
            link.flush()
        except Exception as e:
            link.close()
            raise self._failed(e) from e
        try:
            self.sync()
        except Exception as e:
            raise StageFailed(Outcome(self.index, "failed", "sync", message=_first_line(e))) from e
        return losses

    def run_eval(self, chunks: int, inputs: list[torch.Tensor] | None, timeout: float) -> list[torch.Tensor]:
        """Forwards in eval mode of ``chunks`` micro-batches (stage 0 reads ``inputs``), handed on like a
        step's; the last stage's outputs (empty on the others)."""
        link = self._link()
        self.weights.wait()
        try:
            link.start(-1, timeout)
            outs: list[torch.Tensor] = walk_eval(self.num_stages, chunks, {self.index: self.rt}, link, inputs)
            link.flush()
        except Exception as e:
            link.close()
            raise self._failed(e) from e
        return outs

    def _link(self) -> GroupLink:
        if self.link is None or self.link.closed:
            raise RuntimeError(f"stage {self.index}: not connected to the pipeline's group")
        return self.link

    def _failed(self, e: Exception) -> StageFailed:
        if isinstance(e, StageFailed):
            return e
        if isinstance(e, LinkError):
            return StageFailed(Outcome(self.index, "failed", e.reason, self._task, e.peer, e.kind, e.microbatch,
                                       str(e), e.taken))
        return StageFailed(Outcome(self.index, "failed", "error", self._task, message=_first_line(e)))

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        self.weights.before_forward(mb)
        return self.rt.forward(mb, x)

    def backward(self, mb: int, grad: torch.Tensor | None, target: torch.Tensor | None, weight: float,
                 next_mb: int | None) -> tuple[torch.Tensor | None, float]:
        return self.rt.backward(mb, grad, target, weight, next_mb)

    def sync(self) -> int:
        """Push this step's gradients, pull the weights (bsp: now; asp/ssp: in the background)."""
        return self.weights.sync()

    def flush(self) -> int:
        """Wait for a pull still in flight; the version forwards run on now."""
        return self.weights.wait()

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.rt.gradients()

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.weights.wait()
        return self.rt.state_dict()

    def timeline(self) -> list[tuple[str, int, float, float]]:
        out = [(i.kind, i.microbatch, i.start, i.end) for i in self.rt.timeline]
        return out + [("S", -1, a, b) for a, b in self.weights.intervals]

    def versions(self) -> list[tuple[int, int, int, int]]:
        return list(self.rt.versions)

    def offload_stats(self) -> dict[str, int]:
        s = self.rt.offloader.stats
        return {"peak_held_bytes": s.peak_held_bytes, "stored_total": s.stored_total, "raw_total": s.raw_total,
                "peak_stored_bytes": s.peak_stored_bytes}

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        try:
            self.weights.wait()
        finally:
            if self.client is not None:
                self.client.close()  # says goodbye, even after a failed sync



class _Tracked:
    """A stage actor's calls as its walk makes them, each task noted first (to name it if it fails)."""

    def __init__(self, actor: StageActor) -> None:
        self.actor = actor

    def forward(self, mb: int, x: torch.Tensor, /) -> torch.Tensor:
        self.actor._task = Task(mb, self.actor.index, Kind.FORWARD)
        return self.actor.forward(mb, x)

    def backward(self, mb: int, grad: torch.Tensor | None, target: torch.Tensor | None, weight: float,
                 next_mb: int | None, /) -> tuple[torch.Tensor | None, float]:
        self.actor._task = Task(mb, self.actor.index, Kind.BACKWARD)
        return self.actor.backward(mb, grad, target, weight, next_mb)


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
