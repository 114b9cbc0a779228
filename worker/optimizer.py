"""DistributedOptimizer: what a PyTorch training loop touches.

``step()`` pushes the gradients of the model's parameters to the shards and
pulls fresh weights back into the parameters (in place); the optimizer math
and its state live on the servers. Under ``every:X`` it sums X local steps'
gradients and syncs once every X calls, like gradient accumulation; under
``ssp:S`` it waits before its next step until the slowest worker is at most
S steps behind. The servers' sync mode is authoritative: when it is switched
live (``shardps ctl set-sync``), workers follow from their next step.

Over 400 lines: one class whose paths (plain, overlapped, streamed) share
the step's bookkeeping (round, accumulation, rollback, rejoin, the sync mode
followed); what each path does with tensors lives in worker/overlap.py,
worker/streaming/streamer.py and the client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardps.protos.amp import LossScaling
from shardps.protos.optim import Adam
from shardps.protos.syncspec import SyncSpec
from shardps.worker.accumulate import Accumulator
from shardps.worker.client import PSClient, PushResult
from shardps.worker.compress import CompressChoice, Compressor
from shardps.worker.datapath.bucketedpush import BucketedPush
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.errors import RolledBack, ShardError
from shardps.worker.job.rollback import Action, During, decide, resume_step
from shardps.worker.layout import DEFAULT_MAX_WHOLE_BYTES, OptimizerChoice
from shardps.worker.metrics import WorkerMetrics
from shardps.worker.overlap import DEFAULT_BUCKET_BYTES, Overlap
from shardps.worker.rows.modules import RowModules
from shardps.worker.streaming.heap import give_back_freed_memory
from shardps.worker.streaming.streamer import Stream, Streamer

__all__ = ["DistributedOptimizer", "RolledBack"]  # RolledBack: importable from here as before (worker/errors.py)

log = logging.getLogger("shardps.worker")


class DistributedOptimizer:
    """Push gradients, pull weights, under a sync mode; optimizer state on the servers.

    Registration (in ``__init__``) is idempotent across workers: worker 0's
    initial values are kept, and every worker pulls them before its first
    step, so all start equal (as DDP broadcasts rank 0's).

    ``optimizer`` is a spec (``shardps.optim.Adam(lr=1e-3)``) or a callable
    ``(name, tensor) -> spec`` to choose one per tensor (see
    ``shardps.optim.Rules``).

    ``provides_values``: whether this worker's values are the ones registered
    (default: worker 0's); a pipeline's stages, each a worker of its own
    tensors, have one provider per stage.

    ``metrics``: a ``WorkerMetrics`` to record into; by default the
    client's own, when it serves them (``connect(metrics_port=...)`` or
    ``SHARDPS_METRICS_PORT``).

    Mixed precision: ``grad_dtype=torch.bfloat16`` (or float16) sends
    gradients in that dtype; the servers keep fp32 master weights.
    ``pull_dtype=torch.bfloat16`` has the weights come down in bf16 (cast
    from the fp32 masters on the servers): half the bytes, for models that
    compute in bf16 (autocast) anyway.

    ``overlap=True`` (``params`` must be the model): gradients go up in
    buckets of about ``bucket_bytes`` (last layers first, as DDP) while
    backward still runs, and the next step's weights come down while the
    next forward runs: each module's forward waits only for its own
    parameters (a forward pre-hook), the first layers arriving first. The
    weights a module computes with are those the sync mode allows, as
    without overlap. ``step()`` returns before the weights are in: call
    ``synchronize()`` before reading parameters outside the model's forward
    (a ``state_dict()`` for a checkpoint, a copy of the weights). A step
    whose backward ran more than once (gradient accumulation by hand) is
    detected and pushed whole at ``step()``.
    ``loss_scaling=True`` (or a ``shardps.LossScaling``) turns on dynamic loss
    scaling run by the servers: multiply the loss by ``opt.loss_scale`` (or
    call ``opt.scale(loss)``) before ``backward()``; a step in which any
    worker's gradient holds an inf/nan is skipped on every shard, and every
    worker gets the new scale with its next pull.

    ``compress=shardps.compress.TopK(0.01)`` (or ``PowerSGD(rank=4)``, or
    ``Rules`` of them per tensor) sends gradients compressed, with error
    feedback and an optional dense warm-up; tensors under
    ``shardps.compress.DENSE_BELOW`` elements and biases stay dense. Not
    with ``overlap`` or ``loss_scaling``. See docs/compression.md.

    Each shard's pull begins as soon as that shard answered the step's push.
    ``push_window=w`` sends the shards' pushes w at a time, in an order
    that spreads the workers over the server hosts (``worker/datapath/pushorder.py``):
    with a model cut into many shards (``shardps server --shards``) the
    first shards' weights come down while the last gradients go up. None
    (the default): every shard's push at once.

    ``stream=shardps.Stream(max_live_bytes)`` (``params`` must be the model):
    the worker holds only the weights of the modules running, pulled before
    each module's forward and backward and released after, each gradient
    pushed as soon as backward completes it (``opt.stream``: the
    ``Streamer``, its ``peak_live_bytes``). Not with ``overlap`` (it
    overlaps already) or ``compress``. See docs/streaming.md.
    """

    streamer_class: type[Streamer] = Streamer  # what runs ``stream=`` (a pipeline stage's runs micro-batches)

    def __init__(self, params: nn.Module | Iterable[tuple[str, torch.Tensor]], client: PSClient, *,
                 optimizer: OptimizerChoice | None = None, sync: str = "bsp",
                 grad_dtype: torch.dtype | None = None, loss_scaling: bool | LossScaling = False,
                 max_whole_bytes: int = DEFAULT_MAX_WHOLE_BYTES, metrics: WorkerMetrics | None = None,
                 staleness_remedy: str = "none", provides_values: bool | None = None,
                 overlap: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 pull_dtype: torch.dtype | None = None, push_window: int | None = None,
                 compress: CompressChoice | None = None, stream: Stream | None = None) -> None:
        named = params.named_parameters() if isinstance(params, nn.Module) else params
        self.params: dict[str, torch.Tensor] = {n: p for n, p in named if p.requires_grad}
        if not self.params:
            raise ValueError("no parameters that require grad")
        if overlap and not isinstance(params, nn.Module):
            raise ValueError("overlap=True needs the model (an nn.Module), not a list of parameters: "
                             "its forward pre-hooks wait for the weights being pulled")
        if pull_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"pull_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {pull_dtype}")
        self.pull_dtype = None if pull_dtype == torch.float32 else pull_dtype
        if compress is not None and (overlap or loss_scaling):
            raise ValueError(f"compress= with {'overlap=True' if overlap else 'loss_scaling'} is not supported: "
                             f"compression runs at step() on unscaled gradients (docs/compression.md)")
        self.compressor: Compressor | None = None
        if stream is not None:
            if not isinstance(stream, Stream):
                raise ValueError(f"stream must be a shardps.Stream, got {stream!r}")
            if not isinstance(params, nn.Module):
                raise ValueError("stream= needs the model (an nn.Module): its modules' hooks fetch the weights")
            if overlap or compress is not None:
                raise ValueError(f"stream= with {'overlap=True' if overlap else 'compress='} is not supported: "
                                 f"a streamed model pushes during backward already (docs/streaming.md)")
        self.stream: Streamer | None = None
        if push_window is not None and push_window < 1:
            raise ValueError(f"push_window must be >= 1 (or None: every shard at once), got {push_window}")
        self.push_window = push_window
        self.overlap: Overlap | None = None
        self.client = client
        self.sync = SyncSpec.parse(sync)
        self.optimizer = optimizer if optimizer is not None else Adam()
        self.local_steps = 0  # calls of step()
        self.round = 0  # syncs with the servers (the clock sent as `step`)
        self.pushes = 0
        self.last_push: list[PushResult] = []
        self.accumulator = Accumulator()  # every:X: the local steps' gradients before the one that pushes
        self.rows = RowModules({})  # the model's row modules, attached once the worker has joined (below)
        self.metrics = metrics
        self._last_step_end: float | None = None
        self.sync_history: list[str] = []  # the mode each sync round ran under
        scaling = LossScaling() if loss_scaling is True else (loss_scaling or None)

        def register() -> None:
            tensors: dict[str, torch.Tensor] = self.params
            provides = provides_values
            if self.stream is not None:  # a rejoin: the weights are released; the shapes are what it needs
                tensors = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in self.params.items()}
                provides = False
            client.register(tensors, self.optimizer, sync=str(self.sync), grad_dtype=grad_dtype,
                            loss_scaling=scaling, max_whole_bytes=max_whole_bytes,
                            staleness_remedy=staleness_remedy, provides_values=provides)

        self._register = register
        if stream is not None:  # before registering: what registration and the released weights free leaves the RSS
            give_back_freed_memory()
        self.rejoins = 0
        self.rollbacks = 0
        self._join()
        # Row tables (worker/rows/modules.py): the model's shardps.nn.Embedding modules, registered here, their
        # gradients pushed at each step() (docs/sparse.md).
        self.rows = RowModules.attach(params, client.rows, num_workers=client.num_workers, sync=str(self.sync),
                                      provides_values=client.worker_id == 0 if provides_values is None
                                      else provides_values, clock=lambda: self.local_steps,
                                      pull_failed=self.pull_failed)
        if compress is not None:  # the registered layouts and shard map say where each part goes
            assert client.shard_map is not None
            self.compressor = Compressor(compress, self.params, client.layouts, client.shard_map, client.chunk_bytes)
        if self.metrics is None:  # the client's, when it serves metrics (metrics_port / SHARDPS_METRICS_PORT)
            self.metrics = client.metrics
            if self.metrics is not None and isinstance(params, nn.Module):  # its MoE layers' counters beside
                self.metrics.add_moe(params)
        if overlap:
            assert isinstance(params, nn.Module)
            self.overlap = Overlap(self, params, bucket_bytes)
        if stream is not None:  # from here on the weights come and go with the modules
            assert isinstance(params, nn.Module)
            self.stream = self.streamer_class(self, params, stream)

    def _join(self) -> None:
        """Register (idempotent), pull the current weights and go on from this worker's clock."""
        self._register()
        self.round = self.client.clock  # a worker (re)joining a running job goes on from its clock
        try:
            self._pull_all(self.client.ready_versions)  # with its last push in, where a barrier still holds it
        except ShardError as e:
            if decide(e, During.JOIN) is not Action.RESYNC:
                raise
            self._resync()  # joining a job whose shards restarted
        self.accumulator.reset()
        self.rows.reset()
        if self.compressor is not None:  # a rejoin: what the residuals held is stale
            self.compressor.reset()
        self.local_steps = resume_step(self.round, self.sync)
        self._follow()

    def _resync(self, attempts: int = 10) -> None:
        """Take the job's epoch, clock and weights. Two workers that recover at once may each start a
        rollback; a pull that meets the second one (ABORTED: a newer epoch) resyncs again."""
        for _ in range(attempts):
            self.round = self.client.recover()
            try:
                self._pull_all()
                return
            except ShardError as e:
                if decide(e, During.RESYNC) is not Action.RESYNC:
                    raise
                log.info("worker %d: the job rolled back again while resyncing: %s", self.client.worker_id,
                         e.details)
        raise RuntimeError(f"worker {self.client.worker_id}: the job kept rolling back ({attempts} times) "
                           f"while this worker resynced")

    def _pull_all(self, min_versions: list[int] | None = None) -> None:
        """Every weight from the shards (each at ``min_versions`` at least); streamed: none, the next forward
        pulls each module's (from the versions the client has now, or ``min_versions``)."""
        if self.stream is not None:
            self.stream.reset()
            if min_versions is not None:
                self.stream.weights_from(min_versions, 0)
            return
        self.client.pull(out=self.params, dtype=self.pull_dtype, min_versions=min_versions)

    def gradients(self) -> dict[str, torch.Tensor]:
        """This step's gradients to push, by name (the TP stepper's are its slices: worker/tp/stepper.py)."""
        return {n: p.grad for n, p in self.params.items() if p.grad is not None}

    def push_gradients(self, grads: dict[str, torch.Tensor], **options: Any) -> list[PushResult]:
        """The step's push (``PSClient.push``'s arguments)."""
        return self.client.push(grads, **options)

    #: Whether a step's push asks the shards to answer with their weights (``push(pull_after=...)``): not
    #: when the pull is not of every parameter whole (a TP rank pulls its slices: worker/tp/stepper.py).
    answers_with_weights = True

    def pull_weights(self, *, min_versions: list[int] | None = None, min_clock: int = 0,
                     answered: list[PushResult] | None = None, inline: bool = False,
                     later: bool = False) -> PullInFlight:
        """The pull of the weights into the parameters (``PSClient.pull_async``'s arguments)."""
        return self.client.pull_async(out=self.params, dtype=self.pull_dtype, min_versions=min_versions,
                                      min_clock=min_clock, answered=answered, inline=inline, later=later)

    def pull_failed(self, e: ShardError) -> None:
        """A pull made in a forward or backward failed (a streamed module's, a row table's): roll back (raises
        RolledBack out of it), or return to let ``e`` be raised."""
        if decide(e, During.PULL) is Action.ROLLBACK:
            raise self._recover() from None

    def _recover(self) -> RolledBack:
        """The job rolled back: resync weights and clock; the exception to raise to the loop."""
        self._resync()
        self.accumulator.reset()
        self.rows.reset()
        if self.compressor is not None:
            self.compressor.reset()
        self.local_steps = resume_step(self.round, self.sync)
        self.rollbacks += 1
        self._follow()
        return RolledBack(self.local_steps, self.client.worker_id)

    def _follow(self) -> None:
        """Adopt the job's sync mode as the servers report it (it can be switched live)."""
        if self.client.sync and self.client.sync != str(self.sync):
            new = SyncSpec.parse(self.client.sync)
            log.info("worker %d: sync %s -> %s from step %d", self.client.worker_id, self.sync, new,
                     self.local_steps)
            self.sync = new

    def record_loss(self, loss: float) -> None:
        """Report the training loss (exported as shardps_worker_loss when metrics are on)."""
        if self.metrics is not None:
            self.metrics.loss.set(loss)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when loss scaling is off); with ``overlap``, the newest the pull in
        flight has seen (it comes with the weights)."""
        pull = self.overlap.pull if self.overlap is not None else None
        said = pull.view.loss_scale if pull is not None else None
        return (said if said is not None else self.client.loss_scale) or 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``, as ``GradScaler.scale``: call ``backward()`` on the result."""
        return loss * self.loss_scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimizer step: accumulate, or push + pull. Returns ``closure()`` if given."""
        if self.metrics is not None:
            now = time.perf_counter()
            if self._last_step_end is not None:
                self.metrics.step_seconds.observe(now - self._last_step_end)
            self._last_step_end = now
            self.metrics.steps.inc()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stream is not None:
            self.local_steps += 1
            return self._step_streamed(loss)
        ov = self.overlap
        stream = ov.take_stream() if ov is not None else None
        if ov is not None and ov.pull is not None:  # a step without backward (or one that streamed nothing)
            self.synchronize()
        self.local_steps += 1
        x = self.sync.accumulation  # every:X: the row modules hold their gradients until the step that pushes
        try:  # the row modules' gradients (worker/rows/modules.py); a rollback since is found here first
            self.rows.step(self.local_steps - 1, push=x <= 1 or self.accumulator.steps + 1 >= x, sync=str(self.sync))
        except ShardError as e:
            return self._push_failed(e, loss)
        if stream is not None:
            return self._push_bucketed(stream, loss)
        grads = self.gradients()
        if self.sync.accumulation > 1:
            self.accumulator.add(grads)
            if self.accumulator.steps < self.sync.accumulation:
                return loss
            grads = self.accumulator.mean()
        mode = self.sync
        bases = list(self.client.versions)
        t0 = time.perf_counter()
        min_clock = mode.min_clock(self.round + 1)
        # Each shard's pull begins as soon as that shard answered the push, while the others' go up.
        pull = self.pull_weights(min_clock=min_clock, later=True)
        try:
            # A shard whose weights are ready at once and small answers with them (one call per step); not
            # under a push window, where a push's answer must come fast to free its place.
            answer = self.answers_with_weights and self.push_window is None
            self.last_push = self.push_gradients(grads, step=self.round, base_versions=bases,
                                                 loss_scale=self.client.loss_scale, window=self.push_window,
                                                 pull_after=(self.pull_dtype, min_clock) if answer else None,
                                                 then=pull, compressor=self.compressor)
        except ShardError as e:
            return self._push_failed(e, loss)
        return self._pushed(mode, t0, loss, pull)

    def _push_bucketed(self, stream: BucketedPush, loss: Any) -> Any:
        """Close the step's push stream (the gradients not handed in during backward go now)."""
        assert self.overlap is not None
        mode = self.sync
        t0 = time.perf_counter()
        rest = self.overlap.remaining(stream)
        self.accumulator.reset()
        try:
            if rest:
                stream.add(rest)
            self.last_push = stream.finish()
        except ShardError as e:
            return self._push_failed(e, loss)
        return self._pushed(mode, t0, loss)

    def _step_streamed(self, loss: Any) -> Any:
        """A streamed model's step: its gradients went up during backward; close the push (every:X: sum
        on the host until the step that pushes). The next forward pulls the weights this push made."""
        assert self.stream is not None
        push = self.stream.end_step()
        x = self.sync.accumulation
        if x > 1 and self.accumulator.steps + 1 < x:
            if push is not None:  # the mode changed during the step: what went up cannot be summed again
                push.abort()
                raise RuntimeError("the sync mode changed to every:X during a streamed step's backward")
            self.accumulator.add({})
            return loss
        mode = self.sync
        t0 = time.perf_counter()
        try:
            if push is None:
                push = self.open_bucketed_push()
            rest = self.stream.remaining(push)
            if rest:
                push.add(rest)
            self.last_push = push.finish()
        except ShardError as e:
            return self._push_failed(e, loss)
        self.accumulator.reset()
        self.pushes += 1
        self.round += 1
        self.sync_history.append(str(mode))
        self._follow()
        self.stream.weights_from([r.ready_version for r in self.last_push], self.sync.min_clock(self.round))
        if self.metrics is not None:
            self.metrics.push_seconds.observe(time.perf_counter() - t0)
            self.metrics.clock.set(self.round)
        return loss

    def _push_failed(self, e: ShardError, loss: Any) -> Any:
        """A push failed: roll back (raises RolledBack), rejoin after an eviction, or raise ``e``."""
        action = decide(e, During.PUSH)
        if action is Action.ROLLBACK:
            raise self._recover() from None
        if action is not Action.REJOIN:
            raise e
        # Our lease expired (we were too slow, or cut off): the others went on without us.
        # Rejoin with the current weights; this step's gradient is too stale to keep.
        log.warning("worker %d: %s; rejoining", self.client.worker_id, e.details)
        self.rejoins += 1
        self._join()
        return loss

    def _pushed(self, mode: SyncSpec, t0: float, loss: Any, begun: PullInFlight | None = None) -> Any:
        """The step's push was answered (``last_push``): take what it says of the job, start the pull."""
        t1 = time.perf_counter()
        self.pushes += 1
        self.round += 1
        self.sync_history.append(str(mode))
        self._follow()
        # Each shard says from which version on our gradient is in (under a
        # barrier: once the round completes); ssp also waits for the slowest
        # worker to be within S clocks.
        mins = [r.ready_version for r in self.last_push]
        if self.metrics is not None:
            self.metrics.push_seconds.observe(t1 - t0)
            self.metrics.clock.set(self.round)
        min_clock = self.sync.min_clock(self.round)
        if begun is not None:  # each shard's pull began as its push answered
            self._pulled(begun, t1)
            if self.sync == mode or min_clock <= mode.min_clock(self.round):
                return loss
            # the mode moved to one that waits for more: pull again as it asks
        # Weights a shard answered the push with are those this pull asks, unless the mode moved meanwhile.
        answered = self.last_push if self.sync == mode else None
        pull = self.pull_weights(min_versions=mins, min_clock=min_clock, answered=answered,
                                 inline=self.overlap is None)
        if self.overlap is not None:  # the next forward waits for each module's weights as they come
            self.overlap.coming(pull, t1)
            return loss
        self._pulled(pull, t1)
        return loss

    def _pulled(self, pull: PullInFlight, t1: float) -> None:
        """The step's pull has come in (or failed: a rollback is raised as RolledBack)."""
        try:
            pull.result()
        except ShardError as e:
            if decide(e, During.PULL) is not Action.ROLLBACK:
                raise
            raise self._recover() from None
        self._follow()
        if self.metrics is not None:
            self.metrics.pull_seconds.observe(time.perf_counter() - t1)

    def open_bucketed_push(self, *, hold_gradients: bool = True) -> BucketedPush:
        """This step's push, opened on every shard from the versions pulled (the overlap hooks feed it; the
        streamer, not holding the gradients: ``PSClient.push_bucketed``)."""
        return self.client.push_bucketed(self.round, list(self.client.versions), loss_scale=self.client.loss_scale,
                                         hold_gradients=hold_gradients)

    def synchronize(self) -> None:
        """With ``overlap``: wait until the weights of the last step are in every parameter (no-op
        otherwise). Raises the pull's failure, as ``step()`` would."""
        taken = self.overlap.take_pull() if self.overlap is not None else None
        if taken is not None:
            self._pulled(*taken)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
