"""ShardStore: one shard's tensors, optimizer state, version and sync policy.

Pure Python/torch, no gRPC. Thread-safe: every public method takes the
store's lock; blocking waits (for a version, for tensors another worker
registers) use one condition variable and always have a timeout.

Versions: a shard starts at version 0 and adds one per optimizer step it
applies (under BSP, one per step of the job; under ASP, one per gradient).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardps.protos import codec
from shardps.protos.optim import OptimizerSpec
from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from shardps.server.optim import PartInfo, ServerOptimizer, make_optimizer, state_bytes
from shardps.server.sync import Contribution, Grads, PartKey, SyncPolicy, make_policy, staleness


def fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as one shard holds it: full shape, wire dtype, optimizer, owned ranges."""

    name: str
    shape: tuple[int, ...]
    dtype: int
    optimizer: OptimizerSpec
    parts: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def validate(self) -> None:
        """InvalidArgument naming the tensor when the spec is inconsistent."""
        n = self.name
        if not n:
            raise InvalidArgument("tensor spec without a name")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"tensor {n!r}: negative dimension in shape {fmt_shape(self.shape)}")
        try:
            codec.to_torch_dtype(self.dtype)
        except ValueError as e:
            raise InvalidArgument(f"tensor {n!r}: {e}") from None
        if not self.parts:
            raise InvalidArgument(f"tensor {n!r}: no parts assigned to this shard")
        prev = 0
        for a, b in sorted(self.parts):
            if not (0 <= a < b <= self.numel) or a < prev:
                raise InvalidArgument(
                    f"tensor {n!r}: part [{a}, {b}) is empty, overlaps another or lies outside "
                    f"the tensor's {self.numel} elements (shape {fmt_shape(self.shape)})"
                )
            prev = b

    def diff(self, other: TensorSpec) -> str:
        """What differs from ``other``, for FAILED_PRECONDITION messages ('' if equal)."""
        out = []
        if self.shape != other.shape:
            out.append(f"shape {fmt_shape(self.shape)} vs {fmt_shape(other.shape)}")
        if self.dtype != other.dtype:
            out.append(f"dtype {codec.dtype_name(self.dtype)} vs {codec.dtype_name(other.dtype)}")
        if self.optimizer != other.optimizer:
            out.append(f"optimizer {self.optimizer} vs {other.optimizer}")
        if tuple(sorted(self.parts)) != tuple(sorted(other.parts)):
            out.append(f"parts {sorted(self.parts)} vs {sorted(other.parts)}")
        return "; ".join(out)


@dataclass
class PartState:
    start: int
    stop: int
    weight: torch.Tensor  # fp32 master weights, shaped as the part
    state: dict[str, torch.Tensor]
    info: PartInfo


@dataclass
class TensorEntry:
    spec: TensorSpec
    optimizer: ServerOptimizer
    parts: dict[int, PartState] = field(default_factory=dict)


@dataclass
class PushResult:
    version: int
    applied: bool
    duplicate: bool


class ShardStore:
    """The state of one shard. See the module docstring for the contract."""

    def __init__(self, shard_index: int = 0, num_shards: int = 1, *, sync: str | None = None,
                 num_workers: int | None = None) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self._cond = threading.Condition(threading.Lock())
        self._tensors: dict[str, TensorEntry] = {}
        self._workers: set[int] = set()
        self._sync: SyncSpec | None = None
        self._num_workers: int | None = None
        self._policy: SyncPolicy | None = None
        self.version = 0
        # Counters, read by stats() (and by metrics in a later layer).
        self.pushes_total = 0
        self.duplicate_pushes_total = 0
        self.applied_updates_total = 0
        self.gradients_applied_total = 0
        self.push_bytes_total = 0
        self.pull_bytes_total = 0
        self.apply_seconds_total = 0.0
        self.staleness_counts: Counter[int] = Counter()
        self.worker_clocks: dict[int, int] = {}
        if sync is not None or num_workers is not None:
            if sync is None or num_workers is None:
                raise ValueError("give both sync and num_workers, or neither")
            self.configure(num_workers, sync)

    # -- job and membership -------------------------------------------------

    def configure(self, num_workers: int, sync: str) -> SyncSpec:
        """Set the job's worker count and sync mode once; later calls must agree."""
        try:
            spec = SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        with self._cond:
            if self._sync is None:
                self._sync, self._num_workers = spec, num_workers
                self._policy = make_policy(spec, num_workers)
            elif (self._sync, self._num_workers) != (spec, num_workers):
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs sync={self._sync} with num_workers={self._num_workers}; "
                    f"a worker asked for sync={spec} with num_workers={num_workers}"
                )
            return spec

    def register_worker(self, worker_id: int) -> None:
        with self._cond:
            self.check_worker_id(worker_id)
            self._workers.add(worker_id)

    def check_worker_id(self, worker_id: int) -> None:
        if self._num_workers is None:
            raise FailedPrecondition(f"shard {self.shard_index} has no job yet: register first")
        if not 0 <= worker_id < self._num_workers:
            raise InvalidArgument(
                f"worker_id must be in [0, {self._num_workers}), got {worker_id}"
            )

    def _check_registered(self, worker_id: int) -> None:
        if worker_id not in self._workers:
            raise FailedPrecondition(
                f"worker {worker_id} is not registered on shard {self.shard_index} "
                f"(registered: {sorted(self._workers)})"
            )

    @property
    def sync(self) -> SyncSpec | None:
        return self._sync

    @property
    def num_workers(self) -> int | None:
        return self._num_workers

    # -- tensors ------------------------------------------------------------

    def spec(self, name: str) -> TensorSpec:
        """The registered spec of ``name``; NotFound if there is none."""
        entry = self._tensors.get(name)
        if entry is None:
            raise NotFound(
                f"unknown tensor {name!r} on shard {self.shard_index} "
                f"({len(self._tensors)} tensors registered)"
            )
        return entry.spec

    def names(self) -> list[str]:
        with self._cond:
            return sorted(self._tensors)

    def register_tensors(self, specs: Sequence[TensorSpec],
                         values: dict[PartKey, torch.Tensor] | None) -> list[str]:
        """Create the tensors not yet held, from ``values`` (fp32, one per part).

        Tensors already held must have an equal spec (FAILED_PRECONDITION
        otherwise) and keep their weights. With ``values=None`` nothing is
        created: tensors not yet held are an error (see wait_for_tensors).
        All-or-nothing. Returns the names created.
        """
        for s in specs:
            s.validate()
        with self._cond:
            new = []
            for s in specs:
                entry = self._tensors.get(s.name)
                if entry is not None:
                    d = entry.spec.diff(s)
                    if d:
                        raise FailedPrecondition(
                            f"tensor {s.name!r} is registered on shard {self.shard_index} with a different "
                            f"spec (registered vs requested: {d})"
                        )
                else:
                    new.append(s)
            if new and values is None:
                raise FailedPrecondition(
                    f"tensors {[s.name for s in new][:5]} are not registered on shard "
                    f"{self.shard_index} and no initial values were sent"
                )
            entries = []
            for s in new:
                opt = make_optimizer(s.optimizer)
                entry = TensorEntry(s, opt)
                for a, b in s.parts:
                    v = values.get((s.name, a)) if values is not None else None
                    if v is None or v.numel() != b - a:
                        raise InvalidArgument(f"tensor {s.name!r}: no initial values for part [{a}, {b})")
                    info = PartInfo(s.shape, a, b)
                    w = v.to(torch.float32).reshape(info.shape).contiguous()
                    entry.parts[a] = PartState(a, b, w, opt.init_state(w, info), info)
                entries.append(entry)
            for e in entries:
                self._tensors[e.spec.name] = e
            if entries:
                self._cond.notify_all()
            return [e.spec.name for e in entries]

    def wait_for_tensors(self, names: Iterable[str], timeout: float) -> None:
        """Block until every name is registered; DeadlineExceeded names the missing."""
        wanted = list(names)
        with self._cond:
            ok = self._cond.wait_for(lambda: all(n in self._tensors for n in wanted), timeout)
            if not ok:
                missing = [n for n in wanted if n not in self._tensors]
                raise DeadlineExceeded(
                    f"shard {self.shard_index}: waited {timeout:.1f}s for worker 0 to register "
                    f"{len(missing)} tensors (first: {missing[:3]})"
                )

    # -- the data path ------------------------------------------------------

    def submit(self, worker_id: int, step: int, base_version: int, grads: Grads,
               nbytes: int = 0) -> PushResult:
        """Hand one worker's gradient of ``step`` to the sync policy; apply what is due.

        ``grads`` maps (name, part start) to fp32 tensors the store may keep
        and modify. Raises (changing nothing) for an unregistered worker, a
        step or base version that cannot be, or a step the policy refuses.
        """
        with self._cond:
            self._check_registered(worker_id)
            if step < 0:
                raise InvalidArgument(f"step must be >= 0, got {step}")
            if not 0 <= base_version <= self.version:
                raise InvalidArgument(
                    f"base_version {base_version} is outside [0, {self.version}] "
                    f"(shard {self.shard_index} is at version {self.version})"
                )
            for (name, start), g in grads.items():
                self.spec(name)
                part = self._tensors[name].parts.get(start)
                if part is None:
                    raise InvalidArgument(f"tensor {name!r}: shard {self.shard_index} owns no part at {start}")
                if g.numel() != part.weight.numel():
                    raise InvalidArgument(
                        f"tensor {name!r}: gradient for part [{part.start}, {part.stop}) has "
                        f"{g.numel()} elements, expected {part.weight.numel()}"
                    )
            assert self._policy is not None  # registered workers imply a job
            offer = self._policy.offer(Contribution(worker_id, step, base_version), grads)
            self.pushes_total += 1
            if offer.duplicate:
                self.duplicate_pushes_total += 1
                return PushResult(self.version, applied=False, duplicate=True)
            self.push_bytes_total += nbytes
            self.worker_clocks[worker_id] = max(step, self.worker_clocks.get(worker_id, -1))
            for update in offer.updates:
                t0 = time.perf_counter()
                for (name, start), g in update.grads.items():
                    entry = self._tensors[name]
                    part = entry.parts[start]
                    entry.optimizer.step(part.weight, g.view(part.weight.shape), part.state, part.info)
                self.apply_seconds_total += time.perf_counter() - t0
                self.staleness_counts.update(staleness(self.version, update.contributions))
                self.gradients_applied_total += len(update.contributions)
                self.applied_updates_total += 1
                self.version += 1
            if offer.updates:
                self._cond.notify_all()
            return PushResult(self.version, applied=bool(offer.updates), duplicate=False)

    def wait_version(self, min_version: int, timeout: float) -> int:
        """Block until the shard reaches ``min_version``; return the version then."""
        with self._cond:
            if self._cond.wait_for(lambda: self.version >= min_version, timeout):
                return self.version
            waiting = self._policy.waiting_on() if self._policy else "no job configured"
            raise DeadlineExceeded(
                f"shard {self.shard_index} is at version {self.version}, waited {timeout:.1f}s "
                f"for version {min_version}: {waiting}"
            )

    def read(self, names: Sequence[str], wire_dtype: int | None,
             chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> tuple[int, list[tuple[str, int, int, bytes]]]:
        """A consistent snapshot: (version, [(name, offset, wire dtype, payload)]).

        ``wire_dtype=None`` sends each tensor in its registered dtype. The
        payloads are taken under the lock, so they all belong to ``version``.
        """
        with self._cond:
            entries = [self._tensors.get(n) for n in names]
            for n, e in zip(names, entries):
                if e is None:
                    self.spec(n)  # raises NotFound
            out = []
            nbytes = 0
            for e in entries:
                assert e is not None
                dt = e.spec.dtype if wire_dtype is None else wire_dtype
                tdt = codec.to_torch_dtype(dt)
                for start in sorted(e.parts):
                    w = e.parts[start].weight.reshape(-1)
                    if tdt != torch.float32:
                        w = w.to(tdt)
                    for off, payload in codec.encode_range(w, 0, w.numel(), chunk_bytes):
                        out.append((e.spec.name, start + off, dt, payload))
                        nbytes += len(payload)
            self.pull_bytes_total += nbytes
            return self.version, out

    # -- inspection ---------------------------------------------------------

    def weights(self, name: str) -> dict[int, torch.Tensor]:
        """Copies of the fp32 master weights of ``name``, by part start (for tests and tools)."""
        with self._cond:
            self.spec(name)
            return {s: p.weight.clone() for s, p in self._tensors[name].parts.items()}

    def state_hash(self) -> str:
        """A digest of weights, optimizer state and version: equal iff the state is."""
        import hashlib

        h = hashlib.sha256()
        with self._cond:
            h.update(str(self.version).encode())
            for name in sorted(self._tensors):
                for start, part in sorted(self._tensors[name].parts.items()):
                    h.update(f"{name}:{start}".encode())
                    h.update(part.weight.numpy().tobytes())
                    for k in sorted(part.state):
                        h.update(k.encode())
                        h.update(part.state[k].numpy().tobytes())
        return h.hexdigest()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            tensors = []
            for name in sorted(self._tensors):
                e = self._tensors[name]
                tensors.append({
                    "spec": e.spec,
                    "weight_bytes": sum(p.weight.numel() * 4 for p in e.parts.values()),
                    "optimizer_state_bytes": sum(state_bytes(p.state) for p in e.parts.values()),
                })
            return {
                "shard_index": self.shard_index,
                "num_shards": self.num_shards,
                "version": self.version,
                "sync": str(self._sync) if self._sync else "",
                "num_workers": self._num_workers or 0,
                "registered_workers": sorted(self._workers),
                "tensors": tensors,
                "pushes_total": self.pushes_total,
                "applied_updates_total": self.applied_updates_total,
                "gradients_applied_total": self.gradients_applied_total,
                "push_bytes_total": self.push_bytes_total,
                "pull_bytes_total": self.pull_bytes_total,
                "staleness_counts": dict(self.staleness_counts),
                "worker_clocks": dict(self.worker_clocks),
            }
