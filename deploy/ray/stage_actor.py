"""What runs inside a pipeline's Ray actors: a stage (``StageActor``) and the offload store.

``StageActor`` is a shell: the stage's compute is a ``StageRuntime`` and its
parameter-server side a ``StageWeights`` (both worker/pipeline/, no Ray); the
actor builds them from ``StageOptions`` and connects to the servers. The
driver calls it once per step (``run_step``): the actor walks its own part of
the plan (``walk.walk`` with this stage alone), receiving activations from the
stage before and gradients from the stage after over direct connections to
its neighbours (``SocketLink``; on GPUs the pipeline's nccl group,
``GroupLink``; made by ``connect``), then pushes and pulls its
weights. A failure ends the step on every stage (``StageFailed`` with what the
stage saw). ``OffloadStore`` holds offloaded activations; ``RaySink`` is a
stage's side of it, one connection to the store (worker/pipeline/offloadwire.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from torch import nn

from shardps.deploy.ray.placement import actor_logging
from shardps.protos.security import Security
from shardps.protos.syncspec import SyncSpec
from shardps.worker.experts.moe import ExpertRows
from shardps.worker.groups import GroupSpec, Rendezvous, connect_store, open_group
from shardps.worker.pipeline.failure import Outcome, StageFailed
from shardps.worker.pipeline.link import GroupLink, LinkError
from shardps.worker.pipeline.linkconnect import open_link
from shardps.worker.pipeline.offloadwire import ByteStore, SocketSink
from shardps.worker.pipeline.plan import StepPlan
from shardps.worker.pipeline.rowstage import has_row_modules
from shardps.worker.pipeline.schedule import Kind, Task
from shardps.worker.pipeline.socketlink import SocketLink
from shardps.worker.pipeline.stage import StageRuntime
from shardps.worker.pipeline.streamstage import StageOptimizer
from shardps.worker.pipeline.streamweights import StreamWeights, stage_stream
from shardps.worker.pipeline.walk import walk, walk_eval
from shardps.worker.pipeline.weights import StageWeights, Stepper
from shardps.worker.rows.modules import RowModules
from shardps.worker.streaming.plan import Stream
from shardps.worker.tp.group import Slice, TPGroup
from shardps.worker.tp.split import split, tp_slices


class OffloadStore:
    """Holds offloaded activations between a forward and its backward (CPU memory of its node): a
    ``ByteStore`` (worker/pipeline/offloadwire.py) the stages reach over one connection each, their
    bundles' bytes never through Ray's object store."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.store = ByteStore(ray.util.get_node_ip_address(), timeout=timeout)

    def endpoint(self) -> tuple[str, bytes]:
        """The store's address (``linkconnect.connect``'s) and the token a stage greets it with."""
        return self.store.address, self.store.token

    def info(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), **self.store.info()}


class RaySink(SocketSink):
    """A stage's side of the pipeline's ``OffloadStore`` actor: a ``SocketSink`` whose endpoint the
    actor gives (one Ray call, on first use)."""

    def __init__(self, store: Any, timeout: float = 300.0) -> None:
        def endpoint() -> tuple[str, bytes]:
            addr, token = ray.get(store.endpoint.remote(), timeout=timeout)
            return str(addr), bytes(token)

        super().__init__(endpoint, ray.util.get_node_ip_address(), timeout)


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
    tensor_parallel: int = 1  # ranks of each stage's TP group (docs/tensor-parallel.md)
    tp_plan: dict[str, str] | None = None  # shardps.tp.split's plan over the whole model's module names
    stream: Stream | None = None  # the stages' weights streamed from the servers (docs/streaming.md)
    stream_modules: tuple[str, ...] = ()  # the names (in the whole model) of Stream(modules=...)
    tied: dict[str, int] | None = None  # weights tied across stages -> how many stages use each (StageTies)
    plan_over: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # with ties: the whole model's


class StageActor:
    """Stage ``index`` of ``num_stages`` of pipeline replica ``replica``: runs its part of each step of
    ``module`` (``run_step``, one call a step); with servers it is parameter-server worker ``replica *
    num_stages + index`` of its own parameters. ``forward`` and ``backward`` are what its walk calls per
    task: subclasses may add to them (the fault tests do).

    With ``opts.tensor_parallel`` p > 1 it is rank ``tp_rank`` of its stage's TP group: it splits its
    module by ``opts.tp_plan`` at once, joins the group in ``connect`` (beside its pipeline's, which links
    the stages of the same TP rank) and, with servers, is worker ``(replica * num_stages + index) * p +
    tp_rank`` pushing the whole gradients of the tensors it owns and pulling its slices (``TPOptimizer``)."""

    def __init__(self, module: nn.Module, index: int, num_stages: int, replica: int, opts: StageOptions,
                 tp_rank: int = 0, aliases: dict[str, str] | None = None) -> None:
        actor_logging()
        self.index, self.num_stages, self.replica = index, num_stages, replica
        self.opts, self.tp_rank = opts, tp_rank
        self.tp: TPGroup | None = None
        if opts.tensor_parallel > 1:
            self.tp = TPGroup(None, tp_rank, opts.tensor_parallel)  # its connections come in connect()
            module = split(module, opts.tp_plan or {}, self.tp, strict=False)
        gpu = opts.use_gpu and torch.cuda.is_available()
        device = torch.device("cuda") if gpu else torch.device("cpu")
        self.link: GroupLink | SocketLink | None = None
        self._task: Task | None = None  # the task running now (named when it fails)
        if not opts.use_gpu:
            torch.set_num_threads(max(1, int(opts.num_cpus)))
        sink = RaySink(opts.store) if opts.store is not None else None
        self.rt = StageRuntime(module, index, num_stages, checkpoint=opts.checkpoint, seed=opts.seed,
                               offload=sink, compress=opts.compress, device=device, key_prefix=f"r{replica}",
                               aliases=dict(aliases or {}), shared=dict(opts.tied or {}))
        self.client: Any = None
        # A TP stage's stepper is a collective over its group: made once the group is there (connect).
        self.weights: StageWeights | StreamWeights
        if opts.stream is not None and opts.servers:
            self.weights = StreamWeights(self.rt, opts.sync, stage_stream(opts.stream, module, opts.stream_modules),
                                         self._streamed(opts))
        else:
            self.weights = StageWeights(self.rt, opts.sync, opts.weight_delay,
                                        self._stepper(opts) if opts.servers and self.tp is None else None,
                                        overlap=not has_row_modules(module))

    def _connect_client(self, opts: StageOptions) -> Any:
        from shardps.worker.client import connect

        d, r, p = self.num_stages, self.replica, opts.tensor_parallel
        self.client = connect(list(opts.servers), worker_id=(r * d + self.index) * p + self.tp_rank,
                              num_workers=opts.replicas * d * p, backups=list(opts.backups) or None,
                              security=opts.security)
        return self.client

    def _streamed(self, opts: StageOptions) -> Callable[[nn.Module, Stream], StageOptimizer]:
        def make(module: nn.Module, spec: Stream) -> StageOptimizer:
            return StageOptimizer(module, self._connect_client(opts), optimizer=opts.optimizer, sync=str(opts.sync),
                                  provides_values=(self.replica == 0), stream=spec)
        return make

    def _stepper(self, opts: StageOptions) -> Callable[[list[tuple[str, torch.Tensor]]], Stepper]:
        def make(masters: list[tuple[str, torch.Tensor]]) -> Stepper:
            from shardps.worker.optimizer import DistributedOptimizer

            r = self.replica
            self._connect_client(opts)
            if opts.plan_over:  # weights tied across stages: every stage plans the whole model's shard map
                self.client.plan_over = {n: torch.empty(shape, dtype=dtype, device="meta")
                                         for n, (shape, dtype) in opts.plan_over.items()}
            if self.tp is not None:
                from shardps.worker.tp.servers import TPOptimizer

                return TPOptimizer(masters, self.client, self.tp, slices=tp_slices(self.rt.module),
                                   optimizer=opts.optimizer, sync=str(opts.sync), provides_values=(r == 0))
            opt = DistributedOptimizer(masters, self.client, optimizer=opts.optimizer, sync=str(opts.sync),
                                       provides_values=(r == 0))
            # The stage's row modules (shardps.nn.Embedding, MoE's experts): each table is held by this stage
            # of every replica, so it is pushed as replica r of ``replicas`` workers (bsp over the replicas).
            opt.rows = RowModules.attach(self.rt.module, self.client.rows, num_workers=opts.replicas,
                                         provides_values=(r == 0), sync=str(opts.sync),
                                         clock=lambda: opt.local_steps, worker=r)
            for m in opt.rows.modules.values():
                if isinstance(m, ExpertRows):  # "send": a step's micro-batches' gradients wait on the shards
                    m.hold = True
            return opt
        return make

    def tp_slices(self) -> dict[str, tuple[Slice, tuple[int, ...]]]:
        """This stage's split parameters: how each is split and its whole shape (empty without TP)."""
        return tp_slices(self.rt.module)

    def info(self) -> dict[str, Any]:
        return {"stage": self.index, "replica": self.replica, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "device": str(self.rt.device)}

    def connect(self, rendezvous: Rendezvous, name: str, timeout: float, tp_name: str = "") -> None:
        """Connect to the neighbouring stages of pipeline group ``name`` (a new one after a failure) as stage
        ``index``, at ``rendezvous``, as every stage of the replica does at once (``open_link``: sockets on
        CPU, nccl on a GPU). A TP stage then joins its TP group ``tp_name`` as ``tp_rank``."""
        if self.link is not None:
            self.link.close()
            self.link = None
        store, host = connect_store(rendezvous, timeout), ray.util.get_node_ip_address()
        self.link = open_link(store, name, self.index, self.num_stages, host, timeout, self.rt.device)
        if self.tp is not None:
            backend = "nccl" if self.rt.device.type == "cuda" else "gloo"
            self.tp.attach(open_group(store, GroupSpec(tp_name, self.tp_rank, self.tp.size, backend, timeout), host))
            if self.opts.servers and isinstance(self.weights, StageWeights) and self.weights.stepper is None:
                self.weights = StageWeights(self.rt, self.opts.sync, self.opts.weight_delay, self._stepper(self.opts),
                                            overlap=not has_row_modules(self.rt.module))

    def begin_step(self, step: int, chunks: int, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        if self.tp is not None and loss_fn is not None and hasattr(loss_fn, "group"):
            loss_fn.group = self.tp  # a loss over split logits (vocab_parallel_cross_entropy) takes the group
        self.rt.begin_step(step, chunks)
        self.rt.loss_fn = loss_fn
        self.weights.begin_step()

    def run_step(self, step: int, plan: StepPlan, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable[..., torch.Tensor] | None,
                 timeout: float) -> list[float]:
        """This stage's part of step ``step``: its tasks of ``plan`` in its own order (stage 0 reads
        ``inputs``, the last stage ``targets``), every wait within ``timeout`` seconds; then the push and
        pull of its gradients. The last stage's weighted losses, then the stage's weighted extra loss
        terms (the balancing losses of its MoE layers; worker/experts/auxloss.py): the step's loss is their sum over
        the stages. Raises
        ``StageFailed``; a failure in the walk closes this stage's group, so that its neighbours end too."""
        link = self._link()
        self.begin_step(step, plan.chunks, loss_fn)
        if isinstance(self.weights, StreamWeights):
            self.weights.begin_tasks(plan.orders[self.index])
        self._task = None
        try:
            link.start(step, timeout, plan.orders)
            first_b = next(t.microbatch for t in plan.orders[self.index] if t.kind is Kind.BACKWARD)
            losses: list[float] = walk(plan, {self.index: _Tracked(self, first_b)}, link, inputs, targets)
            link.flush()
            if isinstance(self.rt.offload, SocketSink):
                self.rt.offload.flush(timeout)  # the step's bundles dropped from the store, or its error
        except Exception as e:
            link.close()
            raise self._failed(e) from e
        try:
            self.sync()
        except Exception as e:
            raise StageFailed(Outcome(self.index, "failed", "sync", message=_first_line(e))) from e
        return losses + self.rt.aux_losses

    def run_eval(self, chunks: int, inputs: list[torch.Tensor] | None, timeout: float) -> list[torch.Tensor]:
        """Forwards in eval mode of ``chunks`` micro-batches (stage 0 reads ``inputs``), handed on like a
        step's; the last stage's outputs (empty on the others)."""
        link = self._link()
        self.weights.wait()
        try:
            link.start(-1, timeout, [[Task(mb, s, Kind.FORWARD) for mb in range(chunks)]
                                     for s in range(self.num_stages)])
            outs: list[torch.Tensor] = walk_eval(self.num_stages, chunks, {self.index: self.rt}, link, inputs)
            link.flush()
        except Exception as e:
            link.close()
            raise self._failed(e) from e
        return outs

    def _link(self) -> GroupLink | SocketLink:
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
        if isinstance(self.weights, StreamWeights):
            self.weights.before_backward(mb)
        return self.rt.backward(mb, grad, target, weight, next_mb)

    def sync(self) -> int:
        """Push this step's gradients, pull the weights (bsp: now; asp/ssp: in the background)."""
        return self.weights.sync()

    def flush(self) -> int:
        """Wait for a pull still in flight; the version forwards run on now."""
        return self.weights.wait()

    def gradients(self) -> dict[str, torch.Tensor]:
        if isinstance(self.weights, StreamWeights):
            raise RuntimeError(f"stage {self.index}: a streamed stage keeps no gradients: each went up as the "
                               f"step's last backward completed it")
        return self.rt.gradients()

    def state_dict(self) -> dict[str, torch.Tensor]:
        if isinstance(self.weights, StreamWeights):
            return self.weights.state_dict()
        self.weights.wait()
        return self.rt.state_dict()

    def stream_stats(self, reset: bool = False) -> dict[str, float]:
        """A streamed stage's counters (``StageStreamer.stats``; empty when not streamed); ``reset``: start
        the peaks over after reading them."""
        if not isinstance(self.weights, StreamWeights):
            return {}
        out = self.weights.stats()
        if reset:
            self.weights.reset_peak()
        return out

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
    """A stage actor's calls as its walk makes them, each task noted first (to name it if it fails). After
    the forward of ``first_backward`` (the micro-batch whose backward comes first on this stage) its
    offloaded activations start on their way back (later ones are prefetched by the backward before)."""

    def __init__(self, actor: StageActor, first_backward: int) -> None:
        self.actor, self.first_backward = actor, first_backward

    def forward(self, mb: int, x: torch.Tensor, /) -> torch.Tensor:
        self.actor._task = Task(mb, self.actor.index, Kind.FORWARD)
        y = self.actor.forward(mb, x)
        if mb == self.first_backward:
            self.actor.rt.prefetch(mb)
        return y

    def backward(self, mb: int, grad: torch.Tensor | None, target: torch.Tensor | None, weight: float,
                 next_mb: int | None, /) -> tuple[torch.Tensor | None, float]:
        self.actor._task = Task(mb, self.actor.index, Kind.BACKWARD)
        return self.actor.backward(mb, grad, target, weight, next_mb)


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
