"""``StreamWeights``: the weights side of a pipeline stage whose weights stream from the servers.

``Pipeline(stream=shardps.Stream(...))`` gives each stage this instead of
``StageWeights`` (worker/pipeline/weights.py): no master copy, no installed
copy; the stage's forwards run on its module's own parameters, whose storage
a ``StageStreamer`` (worker/pipeline/streamstage.py) fills before each unit's
forward and backward and releases after. ``sync()`` closes the step's push
(its gradients went up during the last backward) and the next step's first
forward pulls the weights it made. ``check_stream`` says which pipeline
options it combines with, before any actor starts.

Not thread-safe: the stage's task loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardps.protos.syncspec import SyncSpec
from shardps.worker.pipeline.schedule import Kind, Task
from shardps.worker.pipeline.stage import StageRuntime
from shardps.worker.pipeline.streamstage import StageOptimizer, StageStreamer
from shardps.worker.streaming.plan import Stream

# Builds a stage's optimizer over its module, streaming with the given settings.
MakeOptimizer = Callable[[nn.Module, Stream], StageOptimizer]


def check_stream(stream: Any, *, servers: Any, sync: SyncSpec, offload: str | None, tensor_parallel: int,
                 model: nn.Module | Sequence[nn.Module]) -> tuple[Stream | None, tuple[str, ...]]:
    """``Pipeline``'s ``stream=`` checked against its other options (``ValueError`` naming both); the
    settings the stages get (without modules) and the names of ``stream.modules`` in the whole model."""
    if stream is None:
        return None, ()
    if not isinstance(stream, Stream):
        raise ValueError(f"stream must be a shardps.Stream, got {stream!r}")
    if not servers:
        raise ValueError("stream= needs servers=: the stages' weights stream from the parameter servers")
    if tensor_parallel > 1:
        raise ValueError(f"stream= with tensor_parallel={tensor_parallel} is not supported: a tensor-parallel "
                         f"stage's optimizer (TPOptimizer) does not stream")
    if offload:
        raise ValueError(f"stream= with offload={offload!r} is not supported: the offload hooks would take the "
                         f"streamed weights a backward saves for activations")
    if not sync.barrier:
        raise ValueError(f"stream= with sync={str(sync)!r} is not supported: a streamed stage pulls each "
                         f"micro-batch's weights again and needs them not to move within a step (bsp, every:X)")
    names: list[str] = []
    if stream.modules:
        whole = model if isinstance(model, nn.Module) else nn.Sequential(*model)
        by_id = {id(m): n for n, m in whole.named_modules()}
        for m in stream.modules:
            if id(m) not in by_id:
                raise ValueError(f"Stream(modules=...): {type(m).__name__} is not a module of the pipeline's model")
            names.append(by_id[id(m)])
    return Stream(stream.max_live_bytes, stream.prefetch, stream.keep), tuple(names)


def stage_stream(spec: Stream, module: nn.Module, names: Sequence[str]) -> Stream:
    """``spec`` for a stage whose module is ``module``: the named modules that are in it."""
    chosen = [m for n, m in module.named_modules() if n and n in set(names)]
    return Stream(spec.max_live_bytes, spec.prefetch, spec.keep, chosen or None)


class StreamWeights:
    """The weights side of stage ``runtime`` under a barrier ``sync``, its parameters streamed by the
    optimizer ``make(module, spec)`` builds (see the module docstring). The interface of ``StageWeights``."""

    stash = False
    weight_delay = 0

    def __init__(self, runtime: StageRuntime, sync: SyncSpec, spec: Stream, make: MakeOptimizer) -> None:
        if not sync.barrier:
            raise ValueError(f"a streamed stage needs a barrier sync mode (bsp, every:X), got {sync}")
        self.runtime, self.sync_spec = runtime, sync
        self.intervals: list[tuple[float, float]] = []
        self.stepper = make(runtime.module, spec)
        streamer = self.stepper.stream
        assert isinstance(streamer, StageStreamer)
        self.streamer = streamer
        # The forwards run on the module's own parameters (their hooks hand the gradients in); the stage's
        # detached views of the old storage go.
        runtime.install({**runtime.params, **self.stepper.params}, detach=False)

    @property
    def version(self) -> int:
        return self.runtime.version

    def begin_step(self) -> None:
        self.intervals = []

    def begin_tasks(self, order: Sequence[Task]) -> None:
        """The stage's tasks of this step, in its order (after the runtime's ``begin_step``)."""
        rt = self.runtime
        self.streamer.begin_step([(t.kind, t.microbatch, rt.recomputes(t.microbatch)) for t in order])

    def before_forward(self, mb: int) -> None:
        self.streamer.before_task(Kind.FORWARD, mb)

    def before_backward(self, mb: int) -> None:
        self.streamer.before_task(Kind.BACKWARD, mb)

    def sync(self) -> int:
        """After the step's last backward: close its push (every:X: sum until the step that pushes). The
        next forwards pull what it made. Returns the version forwards run on now."""
        t0 = time.time()
        try:
            self.stepper.step()
        finally:
            self.streamer.training = False
            self.intervals.append((t0, time.time()))
        self.runtime.install(self.runtime.params, detach=False)  # a new version (the same tensors)
        return self.version

    def wait(self) -> int:
        """Nothing runs in the background; a step that failed midway is let go of (its weights released,
        a push it opened cancelled), so that an evaluation after it streams as one. The version."""
        if self.streamer.training:
            self.streamer.reset()
            self.streamer.training = False
        return self.version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's weights, pulled from the servers into new CPU tensors (the whole stage)."""
        pulled = self.streamer.weights(list(self.stepper.params))
        rest = {n: p.detach().to("cpu").clone() for n, p in self.runtime.params.items() if n not in pulled}
        return {n: (pulled[n] if n in pulled else rest[n]).clone() for n in self.runtime.names}

    def stats(self) -> dict[str, float]:
        return self.streamer.stats()

    def reset_peak(self) -> None:
        self.streamer.reset_peak()
        self.streamer.peak_sum_bytes = 0


__all__ = ["StreamWeights", "check_stream", "stage_stream"]
