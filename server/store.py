"""ShardStore: one shard's tensors, optimizer state, version and sync policy.

Pure Python/torch, no gRPC. Thread-safe: every public method takes the
store's lock; blocking waits (for a version, for tensors another worker
registers) use one condition variable and always have a timeout.

Versions: a shard starts at version 0 and adds one per optimizer step it
applies (under BSP, one per step of the job; under ASP, one per gradient).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardps.protos import codec, framing
from shardps.protos.optim import OptimizerSpec
from shardps.protos.syncspec import SyncSpec
from shardps.server import checkpoint
from shardps.server.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreError,
    Unavailable,
)
from shardps.server.exchange import ExchangeTable, PeerChannels, PeerReducer
from shardps.server.optim import PartInfo, ServerOptimizer, make_optimizer, state_bytes
from shardps.server.remedies import Remedy, compensate, lr_factor
from shardps.server.replication import (
    DEFAULT_REPLICA_TIMEOUT_S,
    Deposed,
    Op,
    Replicator,
    pack,
    primary_serving,
)
from shardps.server.scaling import LossScaler, unscale_and_check
from shardps.server.sync import (
    BarrierPolicy,
    Contribution,
    Grads,
    PartKey,
    SyncPolicy,
    Update,
    make_policy,
    staleness,
)

log = logging.getLogger("shardps.server")

DEFAULT_LEASE_S = 10.0

_COUNTERS = ("pushes_total", "duplicate_pushes_total", "applied_updates_total", "gradients_applied_total",
             "push_bytes_total", "pull_bytes_total", "skipped_steps_total", "sync_switches_total", "pulls_total",
             "leaves_total")


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
    grad_dtype: int = 0  # 0: the same as dtype
    peers: tuple[str, ...] = ()  # split non-elementwise tensors: every shard's address
    holders: tuple[int, ...] = ()  # ... and the shards holding one part each, in row order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def push_dtype(self) -> int:
        return self.grad_dtype or self.dtype

    @property
    def split(self) -> bool:
        """Split across shards and stepped with cross-shard statistics."""
        return len(self.holders) > 1

    def validate(self) -> None:
        """InvalidArgument naming the tensor when the spec is inconsistent."""
        n = self.name
        if not n:
            raise InvalidArgument("tensor spec without a name")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"tensor {n!r}: negative dimension in shape {fmt_shape(self.shape)}")
        if len(self.shape) > 16 or self.numel >= 1 << 48:
            raise InvalidArgument(f"tensor {n!r}: shape {fmt_shape(self.shape)[:200]} is beyond what a shard "
                                  f"holds (at most 16 dims and 2**48 elements)")
        try:
            codec.to_torch_dtype(self.dtype)
            codec.to_torch_dtype(self.push_dtype)
        except ValueError as e:
            raise InvalidArgument(f"tensor {n!r}: {e}") from None
        if self.holders:
            if len(self.parts) != 1 or len(set(self.holders)) != len(self.holders):
                raise InvalidArgument(f"tensor {n!r}: a split tensor has one part per holder shard, "
                                      f"got {len(self.parts)} parts and holders {list(self.holders)}")
            if max(self.holders) >= len(self.peers):
                raise InvalidArgument(f"tensor {n!r}: holders {list(self.holders)} but only "
                                      f"{len(self.peers)} peer addresses")
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
        if self.push_dtype != other.push_dtype:
            out.append(f"grad dtype {codec.dtype_name(self.push_dtype)} vs {codec.dtype_name(other.push_dtype)}")
        if self.holders != other.holders:
            out.append(f"holder shards {list(self.holders)} vs {list(other.holders)}")
        if self.optimizer != other.optimizer:
            out.append(f"optimizer {self.optimizer} vs {other.optimizer}")
        if tuple(sorted(self.parts)) != tuple(sorted(other.parts)):
            out.append(f"parts {sorted(self.parts)} vs {sorted(other.parts)}")
        return "; ".join(out)


class _Framed(list):  # type: ignore[type-arg]
    """A list of framed Pull responses that the store can refer to weakly."""

    __slots__ = ("__weakref__",)


def spec_to_json(sp: TensorSpec) -> dict[str, Any]:
    return {"name": sp.name, "shape": list(sp.shape), "dtype": sp.dtype, "grad_dtype": sp.grad_dtype,
            "optimizer": {"name": sp.optimizer.name, "params": sp.optimizer.params()},
            "parts": [list(p) for p in sp.parts], "peers": list(sp.peers), "holders": list(sp.holders)}


def spec_from_json(d: dict[str, Any]) -> TensorSpec:
    from shardps.protos.optim import spec_from_name

    return TensorSpec(d["name"], tuple(d["shape"]), d["dtype"],
                      spec_from_name(d["optimizer"]["name"], **d["optimizer"]["params"]),
                      tuple(tuple(p) for p in d["parts"]), d["grad_dtype"], tuple(d["peers"]), tuple(d["holders"]))


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
    rounds: int = 0  # optimizer steps applied to this tensor


@dataclass
class PushResult:
    version: int  # the shard's version now
    applied: bool
    duplicate: bool
    loss_scale: float = 0.0
    ready_version: int = 0  # the first version that includes this gradient


class ShardStore:
    """The state of one shard. See the module docstring for the contract."""

    def __init__(self, shard_index: int = 0, num_shards: int = 1, *, sync: str | None = None,
                 num_workers: int | None = None, exchange_timeout_s: float = 60.0,
                 lease_s: float = DEFAULT_LEASE_S, role: str = "primary") -> None:
        if role not in ("primary", "backup"):
            raise ValueError(f"role must be 'primary' or 'backup', got {role!r}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self._cond = threading.Condition(threading.Lock())
        self._tensors: dict[str, TensorEntry] = {}
        self._workers: set[int] = set()  # registered and live
        self._evicted: set[int] = set()
        self._left: set[int] = set()  # said goodbye (Leave): not expected, not an eviction
        self._last_seen: dict[int, float] = {}
        self.lease_s = lease_s
        self.evictions_total = 0
        self.leaves_total = 0
        self._reaper: threading.Thread | None = None
        self._stop_reaper = threading.Event()
        self._sync: SyncSpec | None = None
        self._num_workers: int | None = None
        self._policy: SyncPolicy | None = None
        self._scaler: LossScaler | None = None
        self._scaling_config: tuple[float, float, float, int] | None = None
        self.remedy = Remedy()
        self._stale_weights: dict[int, dict[PartKey, torch.Tensor]] = {}  # dc-asgd: what each worker pulled
        self._scaled_impls: dict[OptimizerSpec, ServerOptimizer] = {}
        self._pool: dict[PartKey, torch.Tensor] = {}  # one spare staging buffer per part
        # Pull responses framed from the current weights, shared by the Pulls of this version that are
        # answered while another one still streams them (under bsp every worker's, at once after the
        # barrier). Weak references: the bytes live only as long as some Pull sends them. Dropped
        # whenever the weights or the version change.
        self._framed: dict[tuple[Any, ...], tuple[weakref.ref[_Framed], int]] = {}
        self.framed_hits_total = 0
        self._pool_lock = threading.Lock()
        self._ckpt_dir: str | None = None
        self._ckpt_every, self._ckpt_seconds, self._ckpt_keep = 0, 0.0, 3
        self._ckpt_last = time.monotonic()
        self._ckpt_version = -1
        self._ckpt_lock = threading.Lock()
        self.checkpoints_total = 0
        self.closing = False
        self.waiting = 0  # Pulls parked in a barrier/SSP/version wait right now
        self.epoch = 0  # rollbacks of the job so far
        self.recovering = False  # restarted from a checkpoint: data RPCs wait for the job's rollback
        self.exchange = ExchangeTable()
        self.peers = PeerChannels()
        self.exchange_timeout_s = exchange_timeout_s
        self.version = 0
        # Counters, read by stats() (and by metrics in a later layer).
        self.pushes_total = 0
        self.duplicate_pushes_total = 0
        self.applied_updates_total = 0
        self.gradients_applied_total = 0
        self.push_bytes_total = 0
        self.pull_bytes_total = 0
        self.apply_seconds_total = 0.0
        self.skipped_steps_total = 0
        self.sync_switches_total = 0
        self.pulls_total = 0
        self.on_apply: list[Callable[[float], None]] = []  # called with each step's seconds, under the lock
        self.staleness_counts: Counter[int] = Counter()
        self.worker_clocks: dict[int, int] = {}
        # Replication (server/replication.py). A primary with a backup records every change of its
        # state into ``replicator``; a backup ("backup" role) replays them and serves after a Promote.
        self.role = role
        self.address = ""  # this shard's own address, once served
        self.replicator: Replicator | None = None
        self.replica_timeout_s = DEFAULT_REPLICA_TIMEOUT_S
        self.moved_to = ""  # deposed: the backup that took over
        self.primary_address = ""  # backup role: the primary it copies
        self.replica_seq = 0  # backup role: the last op applied
        self.replica_synced = False
        self.replica_incarnation = ""  # backup role: the run of the primary whose copy it holds
        self.promotions_total = 0
        self._replay_lock = threading.Lock()
        if sync is not None or num_workers is not None:
            if sync is None or num_workers is None:
                raise ValueError("give both sync and num_workers, or neither")
            self.configure(num_workers, sync)

    # -- job and membership -------------------------------------------------

    def configure(self, num_workers: int, sync: str, loss_scaling: LossScaler | None = None,
                  remedy: str | None = None) -> SyncSpec:
        """Set the job's worker count, sync mode and loss scaling once; return the mode in force.

        Later calls must agree on the worker count and loss scaling. The sync
        mode is the job's (it may have been switched since): a worker asking
        for another one is told the mode in force and follows it.
        """
        try:
            spec = SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        try:
            rem = Remedy.parse(remedy)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        scaling = None
        if loss_scaling is not None:
            scaling = (loss_scaling.init_scale, loss_scaling.growth_factor, loss_scaling.backoff_factor,
                       loss_scaling.growth_interval)
        with self._cond:
            if self._sync is None:
                self._sync, self._num_workers = spec, num_workers
                self._policy = make_policy(spec, num_workers, self._recycle)
                self._scaler, self._scaling_config = loss_scaling, scaling
                self.remedy = rem
                self._record("configure", {"num_workers": num_workers, "sync": str(spec), "remedy": str(rem),
                                           "scaling": list(scaling) if scaling else None})
            elif self._num_workers != num_workers:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs a job of num_workers={self._num_workers}; "
                    f"a worker registered with num_workers={num_workers}"
                )
            elif self.remedy != rem:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs staleness remedy {self.remedy}; a worker asked for {rem}"
                )
            elif self._scaling_config != scaling:
                raise FailedPrecondition(
                    f"shard {self.shard_index} runs loss scaling {self._scaling_config or 'off'} "
                    f"(init, growth, backoff, interval); a worker asked for {scaling or 'off'}"
                )
            return self._sync

    @property
    def loss_scale(self) -> float:
        """The scale workers should use next; 0.0 when loss scaling is off."""
        return self._scaler.scale if self._scaler is not None else 0.0

    def register_worker(self, worker_id: int) -> None:
        """A worker joins (or rejoins after an eviction): it holds a lease from now on."""
        with self._cond:
            self.check_worker_id(worker_id)
            if worker_id not in self._workers or worker_id in self._evicted:  # a change the backup replays
                self._record("register_worker", {"worker": worker_id})
            if self._left and not self._workers and not self._evicted:
                # Every worker had left: the job ended. A worker registering now starts its next run
                # (e.g. resumed from a checkpoint), in which every worker is expected again. (Not when
                # one was evicted: that one coming back to finish must not wait for those that did.)
                self._left.clear()
                self._live_changed()
            self._workers.add(worker_id)
            self._last_seen[worker_id] = time.monotonic()
            if worker_id in self._evicted or worker_id in self._left:
                level = logging.WARNING if worker_id in self._evicted else logging.INFO
                self._evicted.discard(worker_id)
                self._left.discard(worker_id)
                log.log(level, "shard %d: worker %d rejoined at clock %d", self.shard_index, worker_id,
                        self.worker_clocks.get(worker_id, -1) + 1)
                self._live_changed()

    def leave(self, worker_id: int) -> bool:
        """A worker is done and says so: from now on barriers and SSP clocks go on without it.

        Unlike an eviction this is the normal end of a worker (no warning,
        no ``evictions_total``). Idempotent; registering again rejoins.
        Returns whether the worker was registered.
        """
        with self._cond:
            self.check_worker_id(worker_id)
            if worker_id not in self._workers:
                return False
            self._record("leave", {"worker": worker_id})
            self._workers.discard(worker_id)
            self._left.add(worker_id)
            self._last_seen.pop(worker_id, None)
            self.leaves_total += 1
            log.info("shard %d: worker %d left at clock %d; steps now complete with workers %s", self.shard_index,
                     worker_id, self.worker_clocks.get(worker_id, -1) + 1, sorted(self.live_workers()))
            self._live_changed()
            return True

    def touch(self, worker_id: int) -> None:
        """The worker is alive (any Push, Pull or Heartbeat renews its lease)."""
        with self._cond:
            if worker_id in self._workers:
                self._last_seen[worker_id] = time.monotonic()

    def live_workers(self) -> set[int]:
        """Workers that count for barriers and SSP clocks: all of the job's but the evicted and those that left."""
        return set(range(self._num_workers or 0)) - self._evicted - self._left

    def _live_changed(self) -> None:
        if isinstance(self._policy, BarrierPolicy):
            for update in self._policy.set_expected(self.live_workers()):
                self._apply(update)
        self._cond.notify_all()

    def evict_expired(self, now: float | None = None) -> list[int]:
        """Evict registered workers whose lease expired; barriers complete with the live ones."""
        now = time.monotonic() if now is None else now
        with self._cond:
            if self.role != "primary":  # a backup replays its primary's evictions; a starting one waits
                return []
            expired = [w for w in sorted(self._workers) if now - self._last_seen.get(w, now) > self.lease_s]
            self._evict(expired, now)
            return expired

    def _evict(self, expired: list[int], now: float) -> None:
        if expired:
            self._record("evict", {"workers": expired})
        for w in expired:
            self._workers.discard(w)
            self._evicted.add(w)
            self.evictions_total += 1
            log.warning("shard %d: evicted worker %d: no Push, Pull or Heartbeat for %.1fs (lease %.1fs); "
                        "steps now complete with workers %s", self.shard_index, w,
                        now - self._last_seen.get(w, now), self.lease_s, sorted(self.live_workers()))
        if expired:
            self._live_changed()

    def start_reaper(self) -> None:
        """Check leases in the background, a few times per lease."""
        if self._reaper is not None or self.lease_s <= 0:
            return

        def loop() -> None:
            while not self._stop_reaper.wait(max(0.05, self.lease_s / 4)):
                self.evict_expired()

        self._reaper = threading.Thread(target=loop, name=f"shard{self.shard_index}-leases", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        """Stop the lease checks and wait for the thread to end."""
        self._stop_reaper.set()
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=10)

    def check_worker_id(self, worker_id: int) -> None:
        if self._num_workers is None:
            raise FailedPrecondition(f"shard {self.shard_index} has no job yet: register first")
        if not 0 <= worker_id < self._num_workers:
            raise InvalidArgument(
                f"worker_id must be in [0, {self._num_workers}), got {worker_id}"
            )

    def _check_registered(self, worker_id: int) -> None:
        if worker_id in self._evicted:
            raise FailedPrecondition(
                f"worker {worker_id} was evicted from shard {self.shard_index} (its lease of {self.lease_s:.1f}s "
                f"expired): register again to rejoin"
            )
        if worker_id in self._left:
            raise FailedPrecondition(
                f"worker {worker_id} left the job on shard {self.shard_index}: register again to rejoin"
            )
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
            if s.split and self.shard_index not in s.holders:
                raise InvalidArgument(f"tensor {s.name!r}: shard {self.shard_index} is not among its "
                                      f"holders {list(s.holders)}")
        with self._cond:
            for s in specs:
                if s.split and self.replicator is not None:
                    raise FailedPrecondition(
                        f"tensor {s.name!r} uses {s.optimizer.name}, whose statistics span the whole tensor, and is "
                        f"split across shards {list(s.holders)}: shards with a backup (--replicas 2) keep such "
                        f"tensors whole; pass a larger max_whole_bytes")
                if s.split and not (self._sync is not None and self._sync.barrier):
                    raise FailedPrecondition(
                        f"tensor {s.name!r} uses {s.optimizer.name}, whose statistics span the whole tensor, "
                        f"and is split across shards {list(s.holders)}: that needs sync bsp or every:X, "
                        f"not {self._sync}; keep it whole (a larger max_whole_bytes) or change the sync mode"
                    )
            if self.remedy.kind == "lr-scale":
                for s in specs:
                    if not isinstance(getattr(s.optimizer, "lr", None), (int, float)):
                        raise FailedPrecondition(
                            f"tensor {s.name!r}: staleness remedy lr-scale needs an optimizer with a fixed lr; "
                            f"{s.optimizer.name} has lr={getattr(s.optimizer, 'lr', None)}"
                        )
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
                if e.spec.split:
                    self.peers.set_addresses(e.spec.peers)
            if entries:
                self._record("register_tensors", {"specs": [spec_to_json(e.spec) for e in entries]},
                             {f"{a}/{e.spec.name}": p.weight.clone() for e in entries for a, p in e.parts.items()})
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
               nbytes: int = 0, *, found_inf: bool = False, loss_scale: float = 0.0,
               epoch: int | None = None, checked: bool = False) -> PushResult:
        """Hand one worker's gradient of ``step`` to the sync policy; apply what is due.

        ``grads`` maps (name, part start) to fp32 tensors the store may keep
        and modify (``checked``: the caller has already set ``found_inf`` for
        any inf/nan in them). A gradient computed with a loss scale is unscaled here
        (x 1/loss_scale in fp32). An optimizer step any of whose gradients
        had an inf/nan (flagged by the worker or found here) is skipped on
        every shard alike, and the loss scale backs off. Raises (changing
        nothing) for an unregistered worker, a step or base version that
        cannot be, or a step the policy refuses.
        """
        if not (loss_scale == 0.0 or (math.isfinite(loss_scale) and loss_scale > 0)):
            raise InvalidArgument(f"loss_scale must be a positive finite number or 0, got {loss_scale}")
        with self._cond:
            self.check_epoch(epoch)
            self._check_registered(worker_id)
            self._last_seen[worker_id] = time.monotonic()
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
        # Unscale and check outside the lock: the buffers are this request's own. ``checked``:
        # the caller already looked at every value (the Push assembly does, chunk by chunk).
        if loss_scale or not checked:
            found_inf = unscale_and_check(list(grads.values()), loss_scale) or found_inf
        # The backup replays the gradient as taken in here (unscaled); packed (copied) before the sync
        # policy may sum other workers' gradients into these buffers.
        packed = pack({f"{start}/{name}": g for (name, start), g in grads.items()}) if self.replicator else None
        with self._cond:
            self.check_epoch(epoch)
            assert self._policy is not None  # registered workers imply a job
            last = self.worker_clocks.get(worker_id, -1)
            if step <= last:  # a retry of a push already taken in
                self.pushes_total += 1
                self.duplicate_pushes_total += 1
                ready = self.version + (1 if self._policy.holds(worker_id) else 0)
                return PushResult(self.version, applied=False, duplicate=True, loss_scale=self.loss_scale,
                                  ready_version=ready)
            if step != last + 1:
                raise FailedPrecondition(
                    f"worker {worker_id} pushed step {step}, but its last step on shard {self.shard_index} "
                    f"was {last}: steps go up by one"
                )
            if self.replicator is not None:
                if packed is None:  # a backup was attached in between
                    packed = pack({f"{start}/{name}": g for (name, start), g in grads.items()})
                self.replicator.record("submit", {"worker": worker_id, "step": step, "base_version": base_version,
                                                  "found_inf": found_inf, "nbytes": nbytes}, packed=packed)
            updates = self._policy.offer(Contribution(worker_id, step, base_version, found_inf), grads)
            self.pushes_total += 1
            self.push_bytes_total += nbytes
            self.worker_clocks[worker_id] = step
            applied = False
            for update in updates:
                applied |= self._apply(update)
            ready = self.version + (1 if self._policy.holds(worker_id) else 0)
            self._cond.notify_all()  # versions and clocks moved
            result = PushResult(self.version, applied=applied, duplicate=False, loss_scale=self.loss_scale,
                                ready_version=ready)
            due = applied and self._checkpoint_due() and not self._policy.held()[2] \
                if isinstance(self._policy, BarrierPolicy) else applied and self._checkpoint_due()
        if due:
            self.checkpoint_now()
        return result

    def _impl(self, entry: TensorEntry, factor: float) -> ServerOptimizer:
        """The tensor's optimizer, with its lr scaled by ``factor`` (lr-scale remedy)."""
        if factor == 1.0:
            return entry.optimizer
        spec = dataclasses.replace(entry.spec.optimizer, lr=entry.spec.optimizer.lr * factor)  # type: ignore[attr-defined]
        impl = self._scaled_impls.get(spec)
        if impl is None:
            impl = self._scaled_impls[spec] = make_optimizer(spec)
        return impl

    def staging(self, key: PartKey, numel: int) -> torch.Tensor:
        """An fp32 buffer of ``numel`` for a pushed part: a recycled one when there is one."""
        with self._pool_lock:
            buf = self._pool.pop(key, None)
        if buf is None or buf.numel() != numel:
            buf = torch.empty(numel, dtype=torch.float32)
        return buf

    def _recycle(self, key: PartKey, buf: torch.Tensor) -> None:
        """Keep one spare buffer per part (a gradient that nothing references any more)."""
        with self._pool_lock:
            self._pool.setdefault(key, buf.view(-1))

    def _apply(self, update: Update) -> bool:
        """One optimizer step (or a skipped one); the version advances either way. Under the lock."""
        t0 = time.perf_counter()
        self._framed.clear()
        skip = any(c.found_inf for c in update.contributions)
        if skip:
            self.skipped_steps_total += 1
        else:
            groups: dict[OptimizerSpec, list[tuple[TensorEntry, PartState, torch.Tensor]]] = {}
            stale = staleness(self.version, update.contributions)
            factor = lr_factor(sum(stale) / len(stale)) if self.remedy.kind == "lr-scale" else 1.0
            backup = (self._stale_weights.get(update.contributions[0].worker_id)
                      if self.remedy.kind == "dc-asgd" and len(update.contributions) == 1 else None)
            for (name, start), g in update.grads.items():
                entry = self._tensors[name]
                part = entry.parts[start]
                grad = g.view(part.weight.shape)
                if backup is not None and (name, start) in backup:
                    compensate(grad, part.weight, backup[(name, start)], self.remedy.dc_lambda)
                if entry.spec.split:
                    reduce = PeerReducer(self.exchange, self.peers, name, entry.rounds, self.shard_index,
                                         entry.spec.holders, self.exchange_timeout_s)
                    entry.optimizer.step(part.weight, grad, part.state, part.info, reduce)
                elif entry.spec.optimizer.elementwise or part.info.whole:
                    groups.setdefault(entry.spec.optimizer, []).append((entry, part, grad))
                else:
                    self._impl(entry, factor).step(part.weight, grad, part.state, part.info)
            for items in groups.values():
                impl = self._impl(items[0][0], factor)
                impl.step_many([(p.weight, g, p.state, p.info) for _, p, g in items])
            for name in {name for name, _ in update.grads}:
                self._tensors[name].rounds += 1
        for key, g in update.grads.items():
            self._recycle(key, g)
        if self._scaler is not None:
            self._scaler.update(skip)
        seconds = time.perf_counter() - t0
        self.apply_seconds_total += seconds
        for hook in self.on_apply:
            hook(seconds)
        self.staleness_counts.update(staleness(self.version, update.contributions))
        self.gradients_applied_total += 0 if skip else len(update.contributions)
        self.applied_updates_total += 0 if skip else 1
        self.version += 1
        return not skip

    def _check_halted(self) -> None:
        if self.closing:
            raise Unavailable(f"shard {self.shard_index} is shutting down")
        if self.moved_to:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {self.moved_to}")

    def check_epoch(self, epoch: int | None) -> None:
        """ABORTED when the job was rolled back since the worker's epoch, or this shard awaits it."""
        if self.recovering:
            raise Aborted(f"shard {self.shard_index} restarted from its checkpoint at version {self.version}: "
                          f"the job must roll back to a checkpoint all shards hold "
                          f"(versions here: {self.checkpoint_versions()})")
        if epoch is not None and epoch != self.epoch:
            raise Aborted(f"the job was rolled back (shard {self.shard_index} is in epoch {self.epoch}, "
                          f"the request in {epoch}): resync")

    def wait_version(self, min_version: int, timeout: float, epoch: int | None = None) -> int:
        """Block until the shard reaches ``min_version``; return the version then."""
        with self._cond:
            start_epoch = self.epoch

            def done() -> bool:
                return self.version >= min_version or self.closing or self.epoch != start_epoch or self.moved_to != ""

            self.waiting += 1
            try:
                ok = self._cond.wait_for(done, timeout)
            finally:
                self.waiting -= 1
                self._cond.notify_all()
            if ok:
                self._check_halted()
                self.check_epoch(start_epoch if epoch is None else epoch)
                return self.version
            waiting = self._policy.waiting_on() if self._policy else "no job configured"
            raise DeadlineExceeded(
                f"shard {self.shard_index} is at version {self.version}, waited {timeout:.1f}s "
                f"for version {min_version}: {waiting}"
            )

    def clocks(self) -> dict[int, int]:
        """Each worker's clock: the number of steps it has pushed (0 before its first)."""
        with self._cond:
            return self._clocks()

    def _clocks(self) -> dict[int, int]:
        """Clocks of the live workers (evicted ones do not hold SSP back)."""
        return {w: self.worker_clocks.get(w, -1) + 1 for w in sorted(self.live_workers())}

    def wait_clock(self, min_clock: int, timeout: float) -> int:
        """Block until every worker's clock is >= ``min_clock`` (SSP); return the slowest clock."""
        with self._cond:
            def slowest() -> int:
                c = self._clocks()
                return min(c.values()) if c else 0

            start_epoch = self.epoch
            self.waiting += 1
            try:
                ok = self._cond.wait_for(lambda: slowest() >= min_clock or self.closing or self.epoch != start_epoch
                                         or self.moved_to != "", timeout)
            finally:
                self.waiting -= 1
                self._cond.notify_all()
            if ok:
                self._check_halted()
                self.check_epoch(start_epoch)
                return slowest()
            behind = {w: c for w, c in self._clocks().items() if c < min_clock}
            raise DeadlineExceeded(
                f"shard {self.shard_index}: waited {timeout:.1f}s for every worker to reach clock "
                f"{min_clock} ({self._sync}); behind: {behind}"
            )

    def set_sync(self, sync: str) -> SyncSpec:
        """Switch the running job's sync mode. Held gradients are applied first, none is lost."""
        try:
            spec = SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        with self._cond:
            if self._sync is None or self._num_workers is None or self._policy is None:
                raise FailedPrecondition(f"shard {self.shard_index} has no job yet: nothing to switch")
            if spec == self._sync:
                return spec
            if not spec.barrier and any(e.spec.split for e in self._tensors.values()):
                raise FailedPrecondition(
                    f"shard {self.shard_index} holds tensors split with cross-shard statistics, which "
                    f"need bsp or every:X; cannot switch to {spec}"
                )
            self._record("set_sync", {"sync": str(spec)})
            for update in self._policy.flush():
                self._apply(update)
            old = self._sync
            self._sync, self._policy = spec, make_policy(spec, self._num_workers, self._recycle)
            if isinstance(self._policy, BarrierPolicy):
                self._policy.expected = self.live_workers()
            self.sync_switches_total += 1
            self._cond.notify_all()
        log.info("shard %d: sync %s -> %s", self.shard_index, old, spec)
        return spec

    def read(self, names: Sequence[str], wire_dtype: int | None,
             chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, *, messages: bool = False,
             slowest_clock: int = 0, worker_id: int | None = None) -> tuple[int, list[tuple[str, int, int, bytes]]]:
        """A consistent snapshot: (version, [(name, offset, wire dtype, payload)]).

        ``wire_dtype=None`` sends each tensor in its registered dtype. The
        payloads are taken under the lock, so they all belong to ``version``.

        ``messages=True``: each payload is instead a whole serialized
        ``PullResponse`` (version, the loss scale and sync mode of that
        moment, ``slowest_clock`` as given, and the chunk, its tensor's shape
        on the tensor's first chunk), framed straight from the weights: one
        copy of the data, made once per version for all the Pulls that ask
        the same (every worker's, under bsp).
        """
        with self._cond:
            entries = [self._tensors.get(n) for n in names]
            for n, e in zip(names, entries):
                if e is None:
                    self.spec(n)  # raises NotFound
            out: list[tuple[str, int, int, bytes]] = _Framed() if messages else []
            nbytes = 0
            if self.remedy.kind == "dc-asgd" and worker_id is not None and worker_id in self._workers:
                self._remember_pulled(worker_id, list(names))
            key: tuple[Any, ...] = ()
            if messages:
                key = (tuple(names), wire_dtype, chunk_bytes, slowest_clock, self.loss_scale, str(self._sync or ""))
                ref, shared_bytes = self._framed.get(key, (None, 0))
                shared = ref() if ref is not None else None
                if shared is not None:
                    self.framed_hits_total += 1
                    self.pull_bytes_total += shared_bytes
                    self.pulls_total += 1
                    return self.version, shared
                prefix, suffix = framing.pull_header(self.version, self.loss_scale, str(self._sync or ""),
                                                     slowest_clock)
            for e in entries:
                assert e is not None
                dt = e.spec.dtype if wire_dtype is None else wire_dtype
                tdt = codec.to_torch_dtype(dt)
                shape: tuple[int, ...] = e.spec.shape
                for start in sorted(e.parts):
                    w = e.parts[start].weight.reshape(-1)
                    if tdt != torch.float32:
                        w = w.to(tdt)
                    if messages:
                        for off, n, msg in framing.chunk_messages(
                                prefix, framing.PULL_CHUNK_FIELD, suffix, e.spec.name, dt, shape,
                                w, 0, w.numel(), chunk_bytes, base=start):
                            out.append((e.spec.name, off, dt, msg))
                            nbytes += n
                            shape = ()
                        continue
                    for off, payload in codec.encode_range(w, 0, w.numel(), chunk_bytes):
                        out.append((e.spec.name, start + off, dt, payload))
                        nbytes += len(payload)
            self.pull_bytes_total += nbytes
            self.pulls_total += 1
            if messages:
                self._framed = {k: v for k, v in self._framed.items() if v[0]() is not None}
                self._framed[key] = (weakref.ref(out), nbytes)  # type: ignore[arg-type]
            return self.version, out

    def _remember_pulled(self, worker_id: int, names: list[str]) -> None:
        """dc-asgd: keep the weights ``worker_id`` pulled, to compensate its next gradient."""
        self._record("pulled", {"worker": worker_id, "names": names})
        mine = self._stale_weights.setdefault(worker_id, {})
        for n in names:
            for start, part in self._tensors[n].parts.items():
                kept = mine.get((n, start))
                if kept is None:
                    mine[(n, start)] = part.weight.clone()
                else:
                    kept.copy_(part.weight)

    def export_state(self, names: Sequence[str]) -> tuple[int, list[tuple[str, int, int, str, torch.Tensor]]]:
        """A consistent copy of weights and optimizer state: (version, [(name, start, stop, key, tensor)]).

        ``key`` is "weight" for the fp32 master weights, else the optimizer
        state's own key (e.g. "exp_avg", "step").
        """
        with self._cond:
            for n in names:
                self.spec(n)
            out = []
            for n in names:
                for start, part in sorted(self._tensors[n].parts.items()):
                    out.append((n, start, part.stop, "weight", part.weight.clone()))
                    for key in sorted(part.state):
                        out.append((n, start, part.stop, key, part.state[key].clone()))
            return self.version, out

    # -- inspection ---------------------------------------------------------

    def weights(self, name: str) -> dict[int, torch.Tensor]:
        """Copies of the fp32 master weights of ``name``, by part start (for tests and tools)."""
        with self._cond:
            self.spec(name)
            return {s: p.weight.clone() for s, p in self._tensors[name].parts.items()}

    # -- replication (server/replication.py) ----------------------------------

    def _record(self, kind: str, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Under the lock: a change of state the backup must replay (nothing without a backup)."""
        if self.replicator is not None:
            self.replicator.record(kind, args, tensors)

    def _record_snapshot(self) -> None:
        if self.replicator is not None:
            version, meta, tensors = self._snapshot()
            self.replicator.record("snapshot", {"version": version, "meta": meta}, tensors)

    def _replica_snapshot(self) -> None:
        with self._cond:
            assert self.replicator is not None
            self.replicator.begin_sync()
            self._record_snapshot()

    def attach_replica(self, address: str, timeout: float = 0.0) -> str:
        """Keep a backup of this shard at ``address`` from now on; the replica state after ``timeout``."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 255:
            raise InvalidArgument(f"AttachReplica: expected HOST:PORT, got {address[:300]!r}")
        if address == self.address:
            raise InvalidArgument(f"AttachReplica: {address} is shard {self.shard_index}'s own address")
        with self._cond:
            if self.role != "starting":
                self.check_serving()
            split = [n for n, e in self._tensors.items() if e.spec.split]
            if split:
                raise FailedPrecondition(f"shard {self.shard_index} holds tensors split with cross-shard statistics "
                                         f"({split[:3]}), which cannot be replicated; keep them whole")
            if self.replicator is None:
                self.replicator = Replicator(self.shard_index, self.num_shards, security=self.peers.security,
                                             timeout_s=self.replica_timeout_s, primary_address=self.address)
                self.replicator.on_deposed = self._deposed
            rep = self.replicator
        try:
            rep.attach(address, self._replica_snapshot)
        except Deposed as e:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {e.address}") from None
        log.info("shard %d: replicating to %s", self.shard_index, address)
        return rep.wait_synced(timeout) if timeout > 0 else rep.state

    def _deposed(self, address: str) -> None:
        with self._cond:
            self.role = "deposed"
            self.moved_to = address
            self._cond.notify_all()

    def replicated(self, timeout: float | None = None) -> None:
        """Block until every change made so far is on the backup (at once without one)."""
        rep = self.replicator
        if rep is None:
            return
        try:
            rep.wait(None, 2 * self.replica_timeout_s if timeout is None else timeout)
        except Deposed as e:
            self._deposed(e.address)
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {e.address}") from None
        except TimeoutError as e:
            raise Unavailable(str(e)) from None

    def check_serving(self) -> None:
        """UNAVAILABLE unless this store serves its shard: not a backup, not a deposed primary."""
        if self.role == "backup":
            raise Unavailable(f"this is a backup of shard {self.shard_index} (its primary: "
                              f"{self.primary_address or 'not known yet'}); it serves only after a Promote")
        if self.role == "deposed":
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {self.moved_to}")
        if self.role == "starting":
            raise Unavailable(f"shard {self.shard_index} is starting: it checks whether its backup took over "
                              f"while it was down")

    def start_replicated(self, target: str, timeout: float) -> str:
        """Start as the primary only if the backup at ``target`` has not taken the shard over meanwhile.

        Until the first attempt to sync the backup settles (in sync, backup
        unreachable, or it answers that it was promoted: deposed), data
        RPCs answer UNAVAILABLE. A server restarted after a takeover thus
        never serves a stale copy of its shard.
        """
        with self._cond:
            self.role = "starting"
        self.attach_replica(target)
        assert self.replicator is not None
        state = self.replicator.wait_synced(timeout, settled=("synced", "degraded", "deposed"))
        with self._cond:
            if self.role == "starting":
                self.role = "primary"
            self._cond.notify_all()
        if self.role == "deposed":
            log.error("shard %d: its backup at %s took it over while this server was down; this server does "
                      "not serve it (workers are sent there)", self.shard_index, target)
        return state

    def apply_replica(self, ops: Iterable[tuple[Any, Op]]) -> tuple[int, int]:
        """Backup side: replay the primary's ops in order; (last op applied, version).

        FAILED_PRECONDITION once promoted (the sender is deposed); ABORTED
        when the whole state is needed first (a gap, never synced, a replay
        that failed).
        """
        if self.role == "primary" and not self.promotions_total:  # a misdirected --replica-target
            raise InvalidArgument(f"this endpoint serves shard {self.shard_index} as its primary: it holds no backup")
        for head, op in ops:
            with self._replay_lock:
                if self.role != "backup":
                    raise FailedPrecondition(f"the backup of shard {self.shard_index} here was promoted and serves "
                                             f"the shard now: the old primary must stop")
                if (head.shard_index, head.num_shards) != (self.shard_index, self.num_shards):
                    raise InvalidArgument(f"this endpoint backs shard {self.shard_index} of {self.num_shards}, "
                                          f"got changes of shard {head.shard_index} of {head.num_shards}")
                if self.replica_incarnation and head.incarnation != self.replica_incarnation:
                    raise FailedPrecondition(
                        f"the backup of shard {self.shard_index} here holds the state of an earlier run of its "
                        f"primary (op {self.replica_seq}, version {self.version}): a restarted primary must not "
                        f"overwrite acknowledged updates; this backup takes the shard over instead")
                if op.kind != "snapshot" and (not self.replica_synced or op.seq != self.replica_seq + 1):
                    why = "it never got the whole state" if not self.replica_synced else \
                        f"op {op.seq} came after op {self.replica_seq}"
                    self.replica_synced = False
                    raise Aborted(f"backup of shard {self.shard_index}: {why}: send the whole state")
                try:
                    self._replay(op)
                except StoreError as e:
                    self.replica_synced = False
                    raise Aborted(f"backup of shard {self.shard_index} could not replay op {op.seq} ({op.kind}): "
                                  f"{e}; send the whole state") from None
                self.replica_seq = op.seq
                self.primary_address = head.primary or self.primary_address
                self.replica_incarnation = head.incarnation
        return self.replica_seq, self.version

    def _replay(self, op: Op) -> None:
        a, t = op.args, op.tensors

        def keyed() -> dict[PartKey, torch.Tensor]:
            out = {}
            for key, v in t.items():
                start, name = key.split("/", 1)
                out[(name, int(start))] = v
            return out

        if op.kind == "snapshot":
            self.restore(a["version"], a["meta"], t)
            self.replica_synced = True
        elif op.kind == "configure":
            sc = a["scaling"]
            self.configure(a["num_workers"], a["sync"], LossScaler(*sc) if sc else None, a["remedy"])
        elif op.kind == "register_worker":
            self.register_worker(a["worker"])
        elif op.kind == "register_tensors":
            self.register_tensors([spec_from_json(d) for d in a["specs"]], keyed())
        elif op.kind == "submit":
            self.submit(a["worker"], a["step"], a["base_version"], keyed(), a["nbytes"], found_inf=a["found_inf"],
                        checked=True)
        elif op.kind == "leave":
            self.leave(a["worker"])
        elif op.kind == "evict":
            with self._cond:
                self._evict(list(a["workers"]), time.monotonic())
        elif op.kind == "set_sync":
            self.set_sync(a["sync"])
        elif op.kind == "pulled":
            with self._cond:
                self._remember_pulled(a["worker"], list(a["names"]))
        else:
            raise InvalidArgument(f"unknown replication op {op.kind!r}")

    def promote(self, reason: str = "", force: bool = False) -> None:
        """Backup side: serve the shard from now on (idempotent).

        Refused while the primary still answers its health check with
        SERVING (unless ``force``): a worker that cannot reach a live
        primary must not split the shard in two.
        """
        with self._replay_lock:
            if self.role == "primary":
                return
            if self.role != "backup":
                raise FailedPrecondition(f"shard {self.shard_index} here is {self.role}: it cannot take over")
            if not self.replica_synced:
                raise FailedPrecondition(f"this endpoint holds no copy of shard {self.shard_index} yet: "
                                         f"nothing to take over with")
            if not force and primary_serving(self.primary_address, self.peers.security):
                raise FailedPrecondition(
                    f"the primary of shard {self.shard_index} at {self.primary_address} still answers SERVING: "
                    f"not taking over (`shardps ctl promote --force` overrides)")
            with self._cond:
                self.role = "primary"
                now = time.monotonic()
                self._last_seen = {w: now for w in self._workers}  # a fresh lease at the new address
                self.promotions_total += 1
                self._cond.notify_all()
        log.warning("shard %d: the backup at %s took over from %s at version %d (op %d): %s", self.shard_index,
                    self.address, self.primary_address, self.version, self.replica_seq, reason or "no reason given")

    def stop_replication(self) -> None:
        if self.replicator is not None:
            self.replicator.close()

    # -- checkpoints ----------------------------------------------------------

    def enable_checkpoints(self, directory: str, *, every_steps: int = 0, every_seconds: float = 0.0,
                           keep: int = 3) -> None:
        """Checkpoint into ``directory`` every ``every_steps`` versions and/or after ``every_seconds``.

        Under bsp and every:X all shards apply the same rounds, so step-based
        checkpoints land on the same versions on every shard.
        """
        if every_steps < 0 or every_seconds < 0:
            raise ValueError("checkpoint intervals must be >= 0")
        self._ckpt_dir, self._ckpt_every, self._ckpt_seconds, self._ckpt_keep = (
            directory, every_steps, every_seconds, keep)
        self._ckpt_last = time.monotonic()

    def _checkpoint_due(self) -> bool:
        if not self._ckpt_dir or self._ckpt_version == self.version or self.role != "primary":
            return False
        if self._ckpt_every and self.version % self._ckpt_every == 0:
            return True
        return bool(self._ckpt_seconds) and time.monotonic() - self._ckpt_last >= self._ckpt_seconds

    def checkpoint_now(self) -> str:
        """Write a checkpoint of the current state; return the path of its metadata."""
        if not self._ckpt_dir:
            raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory (--checkpoint-dir)")
        with self._ckpt_lock:
            version, meta, tensors = self.snapshot()
            path = checkpoint.write(self._ckpt_dir, self.shard_index, version, meta, tensors, keep=self._ckpt_keep)
            self._ckpt_version, self._ckpt_last = version, time.monotonic()
            self.checkpoints_total += 1
        log.info("shard %d: checkpoint at version %d: %s", self.shard_index, version, path)
        return str(path)

    def checkpoint_versions(self) -> list[int]:
        return checkpoint.list_versions(self._ckpt_dir, self.shard_index) if self._ckpt_dir else []

    def rollback(self, version: int, epoch: int) -> tuple[int, int]:
        """Restore the checkpoint at ``version`` and enter ``epoch`` (no-op if already there).

        Waits in progress end with ABORTED, so their workers resync too.
        """
        with self._ckpt_lock:
            if epoch <= self.epoch and not self.recovering:
                return self.version, self.epoch
            if not self._ckpt_dir:
                raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory")
            try:
                c = checkpoint.load(self._ckpt_dir, self.shard_index, version)
            except ValueError as e:
                raise FailedPrecondition(f"shard {self.shard_index} cannot roll back to version {version}: {e} "
                                         f"(checkpoints: {self.checkpoint_versions()})") from None
            self.restore(c.version, c.meta, c.tensors())
            with self._cond:
                self.epoch = max(epoch, self.epoch + 1)
                self.recovering = False
                self._ckpt_version = c.version
                self._record_snapshot()
                self._cond.notify_all()
        log.warning("shard %d: rolled back to version %d, epoch %d", self.shard_index, version, self.epoch)
        return self.version, self.epoch

    def restore_latest(self, at_most: int | None = None) -> int | None:
        """Restore the newest complete checkpoint (at or below ``at_most``); its version, or None."""
        if not self._ckpt_dir:
            return None
        c = checkpoint.latest(self._ckpt_dir, self.shard_index, at_most)
        if c is None:
            return None
        self.restore(c.version, c.meta, c.tensors())
        self._ckpt_version = c.version
        return c.version

    def close(self) -> None:
        """Shutting down: waits in progress end with UNAVAILABLE, new requests are refused."""
        self._stop_reaper.set()
        with self._cond:
            self.closing = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.waiting == 0, timeout=5.0)  # parked waits have left

    def snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        """Everything needed to restore this shard: (version, JSON-able meta, tensors).

        Weights, optimizer state, the gradients a barrier round holds, the
        version, each worker's last step (the exactly-once bookkeeping), the
        loss scaler and the counters. Tensors are copies taken under the lock.
        """
        with self._cond:
            return self._snapshot()

    def _snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        tensors: dict[str, torch.Tensor] = {}
        specs = []
        for i, name in enumerate(sorted(self._tensors)):
            e = self._tensors[name]
            sp = e.spec
            specs.append(dict(spec_to_json(sp), rounds=e.rounds))
            for start, part in e.parts.items():
                tensors[f"{i}/{start}/weight"] = part.weight.clone()
                for key, t in part.state.items():
                    tensors[f"{i}/{start}/state/{key}"] = t.clone()
        index = {s["name"]: i for i, s in enumerate(specs)}
        for w, kept in self._stale_weights.items():  # dc-asgd
            for (name, start), t in kept.items():
                tensors[f"stale/{w}/{index[name]}/{start}"] = t.clone()
        pending: dict[str, Any] = {}
        if isinstance(self._policy, BarrierPolicy):
            sums, counts, held = self._policy.held()
            for (name, start), t in sums.items():
                tensors[f"{index[name]}/{start}/held"] = t.clone()
            pending = {"counts": [[index[n], st, c] for (n, st), c in counts.items()],
                       "contributions": [[c.worker_id, c.step, c.base_version, c.found_inf] for c in held],
                       "rounds": self._policy.rounds}
        scaler = None
        if self._scaler is not None:
            sc = self._scaler
            scaler = {"init_scale": sc.init_scale, "growth_factor": sc.growth_factor,
                      "backoff_factor": sc.backoff_factor, "growth_interval": sc.growth_interval,
                      "scale": sc.scale, "growth_tracker": sc.growth_tracker}
        meta = {
            "num_shards": self.num_shards, "sync": str(self._sync) if self._sync else None,
            "num_workers": self._num_workers, "workers": sorted(self._workers), "evicted": sorted(self._evicted),
            "left": sorted(self._left), "worker_clocks": {str(w): c for w, c in self.worker_clocks.items()},
            "scaler": scaler, "remedy": str(self.remedy), "epoch": self.epoch, "tensors": specs, "pending": pending,
            "counters": {k: getattr(self, k) for k in _COUNTERS},
            "staleness_counts": {str(k): v for k, v in self.staleness_counts.items()},
        }
        return self.version, meta, tensors

    def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Replace this shard's whole state with a snapshot (see ``snapshot``)."""
        if meta["num_shards"] != self.num_shards:
            raise FailedPrecondition(f"checkpoint is of a {meta['num_shards']}-shard job; this is shard "
                                     f"{self.shard_index} of {self.num_shards}")
        entries: dict[str, TensorEntry] = {}
        names = []
        for i, sp in enumerate(meta["tensors"]):
            spec = spec_from_json(sp)
            opt = make_optimizer(spec.optimizer)
            entry = TensorEntry(spec, opt, rounds=sp["rounds"])
            for a, b in spec.parts:
                info = PartInfo(spec.shape, a, b)
                state = {k.rsplit("/", 1)[1]: t.clone() for k, t in tensors.items()
                         if k.startswith(f"{i}/{a}/state/")}
                entry.parts[a] = PartState(a, b, tensors[f"{i}/{a}/weight"].clone(), state, info)
            entries[spec.name] = entry
            names.append(spec.name)
        with self._cond:
            self._framed.clear()
            self._tensors = entries
            self._workers = set(meta["workers"])
            self._evicted = set(meta.get("evicted", []))
            self._left = set(meta.get("left", []))
            now = time.monotonic()
            self._last_seen = {w: now for w in self._workers}  # a fresh lease after a restart
            self.worker_clocks = {int(w): c for w, c in meta["worker_clocks"].items()}
            self._num_workers = meta["num_workers"]
            self._sync = SyncSpec.parse(meta["sync"]) if meta["sync"] else None
            self.remedy = Remedy.parse(meta["remedy"])
            sc = meta["scaler"]
            self._scaler = None if sc is None else LossScaler(
                sc["init_scale"], sc["growth_factor"], sc["backoff_factor"], sc["growth_interval"], sc["scale"],
                sc["growth_tracker"])
            self._scaling_config = None if sc is None else (sc["init_scale"], sc["growth_factor"],
                                                            sc["backoff_factor"], sc["growth_interval"])
            self._policy = (make_policy(self._sync, self._num_workers, self._recycle)
                            if self._sync is not None and self._num_workers else None)
            pending = meta.get("pending") or {}
            if isinstance(self._policy, BarrierPolicy) and pending:
                sums = {(names[i], st): tensors[f"{i}/{st}/held"].clone() for i, st, _ in pending["counts"]}
                counts = {(names[i], st): c for i, st, c in pending["counts"]}
                held = [Contribution(w, s_, b, f) for w, s_, b, f in pending["contributions"]]
                self._policy.restore(sums, counts, held, pending["rounds"])
            if isinstance(self._policy, BarrierPolicy):
                self._policy.expected = self.live_workers()
            for k, v in meta["counters"].items():
                setattr(self, k, v)
            self.staleness_counts = Counter({int(k): v for k, v in meta["staleness_counts"].items()})
            self.version = version
            self.epoch = max(self.epoch, meta.get("epoch", 0))
            self._stale_weights = {}
            for key, t in tensors.items():
                if key.startswith("stale/"):
                    _, w, i, st = key.split("/")
                    self._stale_weights.setdefault(int(w), {})[(names[int(i)], int(st))] = t.clone()
            for e in entries.values():
                if e.spec.split:
                    self.peers.set_addresses(e.spec.peers)
            self._cond.notify_all()
        log.info("shard %d: restored version %d (%d tensors)", self.shard_index, version, len(entries))

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
                "evicted_workers": sorted(self._evicted),
                "evictions_total": self.evictions_total,
                "left_workers": sorted(self._left),
                "leaves_total": self.leaves_total,
                "epoch": self.epoch,
                "recovering": self.recovering,
                "waiting_pulls": self.waiting,
                "tensors": tensors,
                "pushes_total": self.pushes_total,
                "applied_updates_total": self.applied_updates_total,
                "gradients_applied_total": self.gradients_applied_total,
                "push_bytes_total": self.push_bytes_total,
                "pull_bytes_total": self.pull_bytes_total,
                "pulls_total": self.pulls_total,
                "staleness_counts": dict(self.staleness_counts),
                "skipped_steps_total": self.skipped_steps_total,
                "sync_switches_total": self.sync_switches_total,
                "staleness_remedy": str(self.remedy),
                "checkpoint_versions": self.checkpoint_versions(),
                "duplicate_pushes_total": self.duplicate_pushes_total,
                "loss_scale": self.loss_scale,
                "worker_clocks": dict(self.worker_clocks),
                "role": self.role,
                "backup": self.replicator.address if self.replicator else "",
                "replica_state": self.replicator.state if self.replicator else "none",
                "replicated_ops_total": self.replicator.ops_total if self.replicator else self.replica_seq,
                "replication_lag_ops": self.replicator.lag if self.replicator else 0,
                "promotions_total": self.promotions_total,
            }
