"""One codec for a shard's state: the snapshot that checkpoints and replication both carry.

A snapshot is (version, meta, tensors): ``meta`` JSON-able, ``tensors`` a
flat dict of named tensors. This module owns every key scheme (formats
unchanged; checkpoint files of earlier runs load):

- snapshot tensors, tensor ``i`` being the i-th registered name in sorted order:
  ``{i}/{start}/weight``, ``{i}/{start}/state/{key}`` (optimizer state),
  ``{i}/{start}/held`` (a barrier round's gradient sum), ``stale/{w}/{i}/{start}``
  (dc-asgd: the weights worker ``w`` pulled);
- meta: see ``encode``; the tensors' specs as ``table.spec_to_json`` plus ``rounds``;
- replication ops' tensors by part: ``{start}/{name}`` (``part_keys`` / ``parse_part_keys``);
- ``pack`` / ``unpack``: tensors as one byte buffer and its layout, the way a
  Replicate op carries them.

server/checkpoint.py writes and reads snapshots as files; server/replication/transport.py
sends them as the ``snapshot`` op. Pure functions over tensors and a
``ShardState``, no lock: the store gathers a ``ShardState`` from its parts
under its lock (``ShardStore.snapshot``) and hands a decoded one back to
them (``ShardStore.restore``). ``state_hash`` digests what must be equal
between a primary and its backup.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import InvalidArgument
from shardps.server.optim import PartInfo, make_optimizer
from shardps.server.remedies import Remedy
from shardps.server.scaling import LossScaler
from shardps.server.sync import Contribution, HeldState
from shardps.server.table import PartKey, PartState, TensorEntry, spec_from_json, spec_to_json

Meta = dict[str, Any]
Tensors = dict[str, torch.Tensor]

COUNTERS = ("pushes_total", "duplicate_pushes_total", "applied_updates_total", "gradients_applied_total",
            "push_bytes_total", "pull_bytes_total", "skipped_steps_total", "sync_switches_total", "pulls_total",
            "leaves_total")


@dataclass
class ShardState:
    """Everything needed to restore a shard, decoded."""

    version: int
    num_shards: int
    sync: SyncSpec | None
    num_workers: int | None
    workers: list[int]
    evicted: list[int]
    left: list[int]
    worker_clocks: dict[int, int]
    scaler: LossScaler | None
    remedy: Remedy
    epoch: int
    entries: dict[str, TensorEntry]
    held: HeldState | None  # what a barrier round holds (None: nothing, or not a barrier mode)
    counters: dict[str, int]
    staleness_counts: Counter[int]
    stale_weights: dict[int, dict[PartKey, torch.Tensor]]
    skips: list[int] = field(default_factory=list)  # evicted workers back, whose next push may skip ahead


def encode(s: ShardState) -> tuple[int, Meta, Tensors]:
    """The snapshot of ``s``; tensors are copies (take it under the store's lock)."""
    tensors: Tensors = {}
    specs = []
    for i, name in enumerate(sorted(s.entries)):
        e = s.entries[name]
        specs.append(dict(spec_to_json(e.spec), rounds=e.rounds))
        for start, part in e.parts.items():
            tensors[f"{i}/{start}/weight"] = part.weight.clone()
            for key, t in part.state.items():
                tensors[f"{i}/{start}/state/{key}"] = t.clone()
    index = {sp["name"]: i for i, sp in enumerate(specs)}
    for w, kept in s.stale_weights.items():  # dc-asgd
        for (name, start), t in kept.items():
            tensors[f"stale/{w}/{index[name]}/{start}"] = t.clone()
    pending: dict[str, Any] = {}
    if s.held is not None:
        for (name, start), t in s.held.sums.items():
            tensors[f"{index[name]}/{start}/held"] = t.clone()
        pending = {"counts": [[index[n], st, c] for (n, st), c in s.held.counts.items()],
                   "contributions": [[c.worker_id, c.step, c.base_version, c.found_inf, c.late]
                                     for c in s.held.contributions],
                   "rounds": s.held.rounds}
    scaler = None
    if s.scaler is not None:
        sc = s.scaler
        scaler = {"init_scale": sc.init_scale, "growth_factor": sc.growth_factor,
                  "backoff_factor": sc.backoff_factor, "growth_interval": sc.growth_interval,
                  "scale": sc.scale, "growth_tracker": sc.growth_tracker}
    meta = {
        "num_shards": s.num_shards, "sync": str(s.sync) if s.sync else None,
        "num_workers": s.num_workers, "workers": sorted(s.workers), "evicted": sorted(s.evicted),
        "left": sorted(s.left), "skips": sorted(s.skips),
        "worker_clocks": {str(w): c for w, c in s.worker_clocks.items()},
        "scaler": scaler, "remedy": str(s.remedy), "epoch": s.epoch, "tensors": specs, "pending": pending,
        "counters": dict(s.counters),
        "staleness_counts": {str(k): v for k, v in s.staleness_counts.items()},
    }
    return s.version, meta, tensors


def decode(version: int, meta: Meta, tensors: Tensors) -> ShardState:
    """A snapshot back as state (tensors copied: the result owns them)."""
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
    pending = meta.get("pending") or {}
    held = None
    if pending:
        held = HeldState(
            sums={(names[i], st): tensors[f"{i}/{st}/held"].clone() for i, st, _ in pending["counts"]},
            counts={(names[i], st): c for i, st, c in pending["counts"]},
            contributions=[Contribution(*c) for c in pending["contributions"]],
            rounds=pending["rounds"])
    sc = meta["scaler"]
    scaler = None if sc is None else LossScaler(
        sc["init_scale"], sc["growth_factor"], sc["backoff_factor"], sc["growth_interval"], sc["scale"],
        sc["growth_tracker"])
    stale: dict[int, dict[PartKey, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("stale/"):
            _, w, idx, at = key.split("/")
            stale.setdefault(int(w), {})[(names[int(idx)], int(at))] = t.clone()
    return ShardState(
        version=version, num_shards=meta["num_shards"],
        sync=SyncSpec.parse(meta["sync"]) if meta["sync"] else None, num_workers=meta["num_workers"],
        workers=list(meta["workers"]), evicted=list(meta.get("evicted", [])), left=list(meta.get("left", [])),
        skips=list(meta.get("skips", [])),
        worker_clocks={int(w): c for w, c in meta["worker_clocks"].items()}, scaler=scaler,
        remedy=Remedy.parse(meta["remedy"]), epoch=meta.get("epoch", 0), entries=entries, held=held,
        counters=dict(meta["counters"]),
        staleness_counts=Counter({int(k): v for k, v in meta["staleness_counts"].items()}),
        stale_weights=stale)


# -- replication ops' tensors, by part ---------------------------------------------


def part_keys(grads: dict[PartKey, torch.Tensor]) -> Tensors:
    return {f"{start}/{name}": g for (name, start), g in grads.items()}


def parse_part_keys(tensors: Tensors) -> dict[PartKey, torch.Tensor]:
    out = {}
    for key, v in tensors.items():
        start, name = key.split("/", 1)
        out[(name, int(start))] = v
    return out


# -- tensors as one buffer (a Replicate op's bytes) -------------------------------


@dataclass(frozen=True)
class Packed:
    """Tensors as one byte buffer: ``layout`` is [[key, dtype, shape, offset], ...] (offsets 8-aligned)."""

    layout: list[list[Any]]
    buffer: torch.Tensor  # uint8

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def pack(tensors: Tensors) -> Packed:
    """Copy ``tensors`` into one buffer (one copy of the data, any dtype)."""
    layout: list[list[Any]] = []
    off = 0
    for key, t in tensors.items():
        layout.append([key, str(t.dtype).removeprefix("torch."), list(t.shape), off])
        off += -(-t.numel() * t.element_size() // 8) * 8
    buf = torch.empty(off, dtype=torch.uint8)
    for (_, _, _, at), t in zip(layout, tensors.values()):
        n = t.numel() * t.element_size()
        if n:
            buf[at:at + n].view(t.dtype).view(t.shape).copy_(t)
    return Packed(layout, buf)


def unpack(layout: Any, data: bytearray) -> Tensors:
    """Views of ``data`` as the tensors of ``layout`` (no copy); InvalidArgument if they do not fit."""
    buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    out = {}
    try:
        for key, dtype_name, shape, at in layout:
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{dtype_name!r} is not a dtype")
            n = math.prod(shape) * dtype.itemsize
            if at % 8 or at < 0 or at + n > len(data) or any(d < 0 for d in shape):
                raise ValueError(f"tensor {key!r} ({n} bytes at {at}) lies outside the op's {len(data)} bytes")
            out[str(key)] = buf[at:at + n].view(dtype).view(shape)
    except (TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise InvalidArgument(f"Replicate: bad tensor layout: {e}") from None
    return out



def state_hash(version: int, entries: Iterable[tuple[str, TensorEntry]]) -> str:
    """A digest of weights, optimizer state and version: equal iff the state is (take it under the lock)."""
    h = hashlib.sha256()
    h.update(str(version).encode())
    for name, entry in sorted(entries, key=lambda item: item[0]):
        for start, part in sorted(entry.parts.items()):
            h.update(f"{name}:{start}".encode())
            h.update(part.weight.numpy().tobytes())
            for k in sorted(part.state):
                h.update(k.encode())
                h.update(part.state[k].numpy().tobytes())
    return h.hexdigest()
