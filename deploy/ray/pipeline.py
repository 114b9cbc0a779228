"""``shardps.ray.Pipeline``: pipeline stages as Ray actors, their weights on the parameter servers.

The driver plans each step (``worker/pipeline/plan.py``) and makes one call
per stage (``StageActor.run_step``): each stage walks its own part of the plan
with the one walker (``worker/pipeline/walk.py``) that ``LocalPipeline`` walks
too, receiving activations from the stage before and gradients from the stage
after, and sending its own on, directly between the actors: over a
connection to each neighbour (``worker/pipeline/socketlink.py``; on GPUs
point-to-point messages over an nccl group of the replica's stages,
``link.py``), each value behind a small header so that shapes may change
between steps. The driver hands the micro-batches to the first stage and
gets the losses from the last. The stages meet at a rendezvous store this
driver hosts, under ``pp/r<replica>/g<n>`` (a new n after a failure), apart
from any other group a stage may join.

The actors (``stage_actor.py``) are shells over the Ray-free ``StageRuntime``
and ``StageWeights``: with ``servers`` every stage is a parameter-server
worker of its own parameters (worker id ``replica * stages + stage``); after
its last backward of a step it pushes its gradients and pulls its weights
under ``sync`` (asp/ssp: overlapping the next step, with weight stashing).

A failed step ends on every stage of the replica (a stage that fails closes
its link, so its neighbours stop waiting at once; a dead one's connections
close by themselves); ``worker/pipeline/failure.py`` names the cause from what
each stage saw, and ``PipelineError`` says it.

``offload="activations"`` sends what the stages save for backward to one
``OffloadStore`` actor, placed on a node offering the ``offload`` resource
when one does. ``stream=shardps.Stream(...)`` has each stage hold only the
weights of the units running (worker/pipeline/streamstage.py).

Over 400 lines: one class, the driver, whose start, step, failure handling
and result calls share its actors and groups; what runs in the actors is
stage_actor.py, the step's plan and walk worker/pipeline/.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import remove_placement_group
from torch import nn

from shardps.deploy.ray.placement import DEFAULT_PLACEMENT_TIMEOUT_S, check_strategy, in_bundle, place
from shardps.deploy.ray.stage_actor import OffloadStore, RaySink, StageActor, StageOptions
from shardps.protos.security import Security
from shardps.protos.syncspec import SyncSpec
from shardps.worker.groups import RendezvousServer
from shardps.worker.pipeline.failure import Outcome, StageFailed, blame
from shardps.worker.pipeline.partition import scatter, split_model, stage_ties
from shardps.worker.pipeline.plan import PipelineOptions, StepPlan, loss_reduction, plan_step
from shardps.worker.pipeline.rowstage import check_row_modules
from shardps.worker.pipeline.streamweights import check_stream
from shardps.worker.streaming.plan import Stream
from shardps.worker.tp.split import check_tp, join_slices

__all__ = ["OffloadStore", "Pipeline", "PipelineError", "RaySink", "StageActor", "StageOptions"]

log = logging.getLogger("shardps.ray")

GRACE_S = 15.0  # the driver waits this much longer than a step's deadline for the stages to report it


class PipelineError(RuntimeError):
    """A step failed: ``stage``, ``microbatch`` and ``kind`` ("forward"/"backward"/"sync") say where."""

    def __init__(self, message: str, stage: int | None = None, microbatch: int | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.stage, self.microbatch, self.kind = stage, microbatch, kind


def _outcome(stage: int, ref: Any) -> tuple[Outcome, Any]:
    """How a stage's call ended (its ref is ready), and its result when it ended well."""
    try:
        return Outcome(stage, "ok"), ray.get(ref, timeout=60)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, StageFailed):
            return cause.outcome, None
        if isinstance(cause, RayActorError) or "ActorDiedError" in str(e):
            return Outcome(stage, "died", message="ActorDiedError"), None
        return Outcome(stage, "failed", "error", message=str(cause or e).splitlines()[0]), None
    except RayActorError as e:
        return Outcome(stage, "died", message=type(e).__name__), None
    except (RayError, GetTimeoutError) as e:
        return Outcome(stage, "failed", "error", message=str(e).splitlines()[0]), None


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
                 security: Security | None = None, offload_resources: dict[str, float] | None = None,
                 tensor_parallel: int = 1, tp_plan: dict[str, str] | None = None, split_output: bool = True,
                 stream: Stream | None = None) -> None:
        self.options = PipelineOptions(schedule, chunks, checkpoint, offload, compress)
        self.stage_modules = split_model(model, balance)
        self.stream, self.stream_modules = check_stream(stream, servers=servers, sync=SyncSpec.parse(sync),
                                                        offload=offload, tensor_parallel=tensor_parallel, model=model)
        self.tp = check_tp(tensor_parallel, tp_plan, self.stage_modules, offload, sync if servers else "bsp")
        self.tp_plan, self.split_output = dict(tp_plan or {}), split_output
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        for name, value in (("step_timeout", step_timeout), ("placement_timeout", placement_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        check_row_modules(self.stage_modules, servers=servers, stream=stream, tensor_parallel=tensor_parallel)
        self.ties = stage_ties(self.stage_modules)
        self._check_ties(servers=bool(servers), sync=SyncSpec.parse(sync), stream=stream,
                         tensor_parallel=tensor_parallel)
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
        self.placement_groups: list[Any] = []  # with TP, one per stage of each replica (STRICT_PACK)
        self.rendezvous: RendezvousServer | None = None
        self._generation = 0  # of the stages' groups: a new one after a failure
        self._connected = False
        self._broken: str | None = None  # why this pipeline cannot run another step (a stage died or hangs)
        self.step_count = 0
        self._t0 = 0.0
        self._closed = False

    def _check_ties(self, *, servers: bool, sync: SyncSpec, stream: Stream | None, tensor_parallel: int) -> None:
        """A weight tied across stages is one tensor on the servers: both stages push their parts of its
        gradient and the servers' barrier adds them, so it needs a barrier mode; not built with streamed or
        tensor-parallel stages. Refused, naming the weight and its users, before any actor starts."""
        if not self.ties.shared:
            return
        name = next(iter(self.ties.shared))
        where = " and ".join(self.ties.users(name, self.stage_modules))
        why = ""
        if servers and not sync.barrier:
            why = (f"needs a barrier sync mode (bsp or every:X), not {sync}: under it each stage's push would "
                   f"step the weight on its own")
        elif stream is not None:
            why = "is not supported with stream= (each streamed stage pushes its units alone)"
        elif tensor_parallel > 1:
            why = "is not supported with tensor_parallel > 1"
        if why:
            raise ValueError(f"Pipeline: {name} is tied across stages ({where}): a tied weight {why}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_modules)

    # -- start ---------------------------------------------------------------

    def _plan_over(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """With weights tied across stages, the whole model's tensors (by the names the stages use): every
        stage plans the shard map over them, so that a tied weight lives on one shard for all its users."""
        if not self.ties.shared:
            return None
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for s, stage in enumerate(self.stage_modules):
            for n, p in stage.named_parameters():
                out.setdefault(self.ties.aliases[s].get(n, n), (tuple(p.shape), p.dtype))
        return out

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
        d, r, p = self.num_stages, self.replicas, self.tp
        bundle = {"CPU": float(self.num_cpus), **self.stage_resources}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        if p == 1:
            self.placement_group = place([dict(bundle) for _ in range(d * r)], self.strategy,
                                         timeout=self.placement_timeout, what=f"pipeline stages ({r} x {d})")
            self.placement_groups = [self.placement_group]
        else:  # each stage's TP group on one node: a STRICT_PACK bundle set per stage
            try:
                for k in range(r * d):
                    self.placement_groups.append(place([dict(bundle) for _ in range(p)], "STRICT_PACK",
                                                       timeout=self.placement_timeout,
                                                       what=f"stage {k % d} of replica {k // d} (TP {p})"))
            except BaseException:
                self.close()
                raise
            self.placement_group = self.placement_groups[0]
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
                                weight_delay=self.weight_delay, tensor_parallel=p, tp_plan=self.tp_plan or None,
                                stream=self.stream, stream_modules=self.stream_modules,
                                tied=dict(self.ties.shared), plan_over=self._plan_over())
            for row_index in range(r * p):  # a row: one TP rank of one replica, all its stages
                rep, t = divmod(row_index, p)
                row = []
                for s, mod in enumerate(self.stage_modules):
                    where = (in_bundle(self.placement_group, rep * d + s) if p == 1 else
                             in_bundle(self.placement_groups[rep * d + s], t))
                    row.append(cls.options(num_cpus=self.num_cpus, num_gpus=1 if self.use_gpu else 0,
                                           resources=self.stage_resources, **where).remote(
                        mod, s, d, rep, opts, t, self.ties.aliases[s]))
                self.stages.append(row)
            self.infos = ray.get([a.info.remote() for row in self.stages for a in row], timeout=600)
            if self.store is not None:
                self.store_info = ray.get(self.store.info.remote(), timeout=120)
            self.rendezvous = RendezvousServer(ray.util.get_node_ip_address(), timeout=self.placement_timeout)
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """Every replica's stages join a new group of their own (at start, and after a failed step)."""
        assert self.rendezvous is not None
        self._generation += 1
        n, p = self._generation, self.tp
        refs = [a.connect.remote(self.rendezvous.address,
                                 f"pp/r{k // p}/g{n}" if p == 1 else f"pp/r{k // p}/t{k % p}/g{n}",
                                 self.placement_timeout, f"tp/r{k // p}/s{s}/g{n}")
                for k, row in enumerate(self.stages) for s, a in enumerate(row)]
        ray.get(refs, timeout=self.placement_timeout + GRACE_S)
        self._connected = True

    def _ready(self, x: torch.Tensor) -> None:
        """Stages started and joined, or ``PipelineError`` saying why this pipeline cannot run."""
        if self._closed:
            raise RuntimeError("this pipeline was closed")
        if self._broken:
            raise PipelineError(self._broken)
        if not self.stages:
            self._dry_run(x)
            self._start()
        elif not self._connected:
            self._connect()

    @property
    def node_ids(self) -> list[list[str]]:
        """The node of every stage: ``node_ids[replica][stage]`` (with TP, ``[replica * p + rank][stage]``)."""
        d = self.num_stages
        return [[i["node_id"] for i in self.infos[r * d:(r + 1) * d]] for r in range(len(self.stages))]

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
        self._ready(x)
        total = len(x)
        d = self.num_stages
        self._t0 = time.time()
        plans: list[StepPlan] = []
        calls: dict[tuple[int, int], Any] = {}
        for rep, (xs, ys) in enumerate(parts):
            sizes = [len(c) for c in xs]
            # The servers average the replicas' gradients: weigh each so that the average is the gradient
            # of the whole batch (R * its share of the samples; the loss is divided by R again below).
            share = self.replicas * (sum(sizes) / total if red == "mean" else 1.0)
            plan = plan_step(self.schedule, sizes, d, red, scale=share)
            for row in range(rep * self.tp, (rep + 1) * self.tp):  # every TP rank runs the same plan
                plans.append(plan)
                for s, actor in enumerate(self.stages[row]):
                    last = s == d - 1
                    calls[(row, s)] = actor.run_step.remote(self.step_count, plan, xs if s == 0 else None,
                                                            ys if last else None, loss_fn if last else None,
                                                            self.step_timeout)
        results = self._collect(calls, plans)
        self.step_count += 1
        # Each stage's weighted losses: the last stage's loss_fn, every stage's MoE balancing losses.
        return float(sum(sum(results[(rep * self.tp, s)]) for rep in range(self.replicas) for s in range(d))
                     / self.replicas)

    def _collect(self, calls: dict[tuple[int, int], Any], plans: list[StepPlan]) -> dict[tuple[int, int], Any]:
        """The results of one call per stage ((replica, stage) -> reference), or ``PipelineError`` naming
        the cause of a failure (``failure.blame``). Once a replica fails, only its stages are waited for:
        they end at once (their groups close) or at the step's deadline."""
        deadline = time.monotonic() + self.step_timeout + GRACE_S
        pending = dict(calls)
        key_of = {ref: key for key, ref in calls.items()}
        results: dict[tuple[int, int], Any] = {}
        outcomes: dict[tuple[int, int], Outcome] = {}
        failing: set[int] = set()
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                key = key_of[ref]
                del pending[key]
                outcomes[key], results[key] = _outcome(key[1], ref)
                if outcomes[key].state != "ok":
                    failing.add(key[0])
            if failing:
                pending = {k: r for k, r in pending.items() if k[0] in failing}
        for key in pending:
            outcomes[key] = Outcome(key[1], "stuck")
            failing.add(key[0])
        if not failing:
            return results
        self._connected = False
        rep = min(failing)
        found = blame(plans[rep], [outcomes[(rep, s)] for s in range(self.num_stages)], step=self.step_count,
                      replica=rep, timeout=self.step_timeout)
        assert found is not None
        message = found.message
        if any(o.state in ("died", "stuck") for o in outcomes.values()):
            self._broken = f"{message}; this pipeline cannot run another step: close it and build a new one"
            if self.servers:
                message += "; rebuild the pipeline: a new Pipeline with the same servers starts from their weights"
        raise PipelineError(message, found.stage, found.microbatch, found.kind)

    # -- results ---------------------------------------------------------------

    def _all(self, method: str, replica: int = 0, rank: int = 0) -> list[Any]:
        if not self.stages:
            raise RuntimeError("no step has run yet: the stages start with the first train_step")
        return ray.get([getattr(a, method).remote() for a in self.stages[replica * self.tp + rank]], timeout=300)

    def _dense(self, method: str, replica: int) -> list[dict[str, torch.Tensor]]:
        """Per stage, ``method``'s tensors by name, split ones joined from the replica's TP ranks."""
        ranks = [self._all(method, replica, t) for t in range(self.tp)]
        if self.tp == 1:
            return ranks[0]
        out = []
        for s, slices in enumerate(self._all("tp_slices", replica)):
            out.append({n: join_slices([ranks[t][s][n] for t in range(self.tp)], *slices[n]) if n in slices else v
                        for n, v in ranks[0][s].items()})
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients by name: of the whole batch (the mean over the replicas' gradients,
        each weighted by its share, as the servers apply it). Not with ``stream=``: no stage keeps them."""
        if self.stream is not None:
            raise RuntimeError("gradients(): a streamed pipeline (stream=) keeps no gradients: each stage pushed "
                               "each as its last backward of the step completed it")
        out: dict[str, torch.Tensor] = {}
        for rep in range(self.replicas):
            for part in self._dense("gradients", rep):
                for n, g in part.items():
                    out[n] = g / self.replicas if n not in out else out[n] + g / self.replicas
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights every stage computes with now (after any pull in flight); a weight tied across stages
        under each of its names, as the whole model's state dict has it."""
        return self.ties.under_every_name({n: t for part in self._dense("state_dict", 0) for n, t in part.items()})

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

    def stream_stats(self, reset: bool = False) -> dict[int, dict[str, float]]:
        """With ``stream=``: per stage of replica 0, its counters since the last reset: ``peak_live_bytes``
        (parameter + gradient storage alive at once), ``max_live_bytes``, ``model_bytes`` (the stage's),
        ``largest_unit_bytes``, ``peak_sum_bytes`` (gradient sums on the host), ``peak_host_bytes``
        (``keep="host"`` copies), ``pulls``, ``pulled_bytes``, ``wait_seconds``. ``reset``: start the peaks
        over after reading them. Empty dicts without ``stream=``."""
        if not self.stages:
            raise RuntimeError("no step has run yet: the stages start with the first train_step")
        d = self.num_stages
        return dict(enumerate(ray.get([a.stream_stats.remote(reset) for a in self.stages[0][:d]], timeout=300)))

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """A forward of ``x`` (eval mode, no gradients) through replica 0's stages, micro-batch by
        micro-batch, handed from stage to stage as a step's forwards are."""
        self._ready(x)
        xs = scatter(x, min(self.chunks, len(x)), "batch")
        d = self.num_stages
        calls = {(t, s): a.run_eval.remote(len(xs), xs if s == 0 else None, self.step_timeout)
                 for t in range(self.tp) for s, a in enumerate(self.stages[t])}
        results = self._collect(calls, [plan_step("gpipe", [len(c) for c in xs], d, "sum")] * self.tp)
        outs = [torch.cat(results[(t, d - 1)]) for t in range(self.tp)]
        return torch.cat(outs, -1) if self.tp > 1 and self.split_output else outs[0]

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
        for pg in self.placement_groups:
            remove_placement_group(pg)
        if self.rendezvous is not None:
            self.rendezvous.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
