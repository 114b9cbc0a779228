"""What runs inside a pipeline's Ray actors: a stage (``StageActor``) and the offload store.

``StageActor`` is a shell: the stage's compute is a ``StageRuntime`` and its
parameter-server side a ``StageWeights`` (both worker/pipeline/, no Ray); the
actor builds them from ``StageOptions``, connects to the servers and forwards
the driver's calls. ``OffloadStore`` holds offloaded activations; ``RaySink``
is a stage's side of it.
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
from shardps.worker.pipeline.stage import StageRuntime
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
    """Stage ``index`` of ``num_stages`` of pipeline replica ``replica``: runs ``module`` as the driver
    calls it, one call at a time; with servers it is parameter-server worker ``replica * num_stages +
    index`` of its own parameters. Subclasses may add to the calls (the fault tests do)."""

    def __init__(self, module: nn.Module, index: int, num_stages: int, replica: int, opts: StageOptions) -> None:
        actor_logging()
        self.index, self.num_stages, self.replica = index, num_stages, replica
        gpu = opts.use_gpu and torch.cuda.is_available()
        device = torch.device("cuda") if gpu else torch.device("cpu")
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

    def begin_step(self, step: int, chunks: int, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        self.rt.begin_step(step, chunks)
        self.rt.loss_fn = loss_fn
        self.weights.begin_step()

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

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weights.wait()
        return self.rt.eval_forward(x)

    def close(self) -> None:
        try:
            self.weights.wait()
        finally:
            if self.client is not None:
                self.client.close()  # says goodbye, even after a failed sync

