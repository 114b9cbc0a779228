"""The tensor table of one shard: what a tensor is (``TensorSpec``) and what the shard holds of it.

- ``TensorSpec``: a tensor as one shard holds it (full shape, wire dtype,
  optimizer, owned ranges, and for a split tensor its peers). The one spec
  class of the server: it converts to and from the wire (``to_proto`` /
  ``from_proto``) and to and from the JSON that checkpoints and replication
  carry (``spec_to_json`` / ``spec_from_json``, format unchanged).
- ``PartState`` / ``TensorEntry``: the fp32 master weights and optimizer
  state of each owned part.
- ``TensorTable``: the entries by name, registration with its validation
  (all-or-nothing). A part of the store that every other part reading
  weights is given; no lock of its own: called under the store's lock. The
  table object lives as long as its store (a restore replaces its entries).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardps.protos import codec
from shardps.protos.optim import OptimizerSpec, spec_from_proto
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import FailedPrecondition, InvalidArgument, NotFound
from shardps.server.optim import PartInfo, ServerOptimizer, make_optimizer, state_bytes
from shardps.server.remedies import Remedy, RemedyKind

PartKey = tuple[str, int]  # (tensor name, start element of the part)


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

    # -- the wire ---------------------------------------------------------------

    @classmethod
    def from_proto(cls, msg: ps_pb2.TensorSpec) -> TensorSpec:
        """A validated spec from a Register's ``TensorSpec`` (InvalidArgument naming the tensor)."""
        try:
            opt = spec_from_proto(msg.optimizer)
        except ValueError as e:
            raise InvalidArgument(f"tensor {msg.name!r}: {e}") from None
        spec = cls(
            name=msg.name,
            shape=tuple(msg.shape),
            dtype=msg.dtype,
            optimizer=opt,
            parts=tuple(sorted((p.start, p.stop) for p in msg.parts)),
            grad_dtype=msg.grad_dtype if msg.grad_dtype != msg.dtype else 0,
            peers=tuple(msg.peers),
            holders=tuple(msg.holders),
        )
        spec.validate()
        return spec

    def to_proto(self) -> ps_pb2.TensorSpec:
        return ps_pb2.TensorSpec(
            name=self.name,
            shape=list(self.shape),
            dtype=self.dtype,  # type: ignore[arg-type]
            optimizer=self.optimizer.to_proto(),
            parts=[ps_pb2.Part(start=a, stop=b) for a, b in self.parts],
            grad_dtype=self.push_dtype,  # type: ignore[arg-type]
            peers=list(self.peers),
            holders=list(self.holders),
        )


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

    @classmethod
    def create(cls, spec: TensorSpec, values: dict[PartKey, torch.Tensor] | None) -> TensorEntry:
        """A new entry from initial values (fp32 copies, one per part); InvalidArgument for a missing part."""
        opt = make_optimizer(spec.optimizer)
        entry = cls(spec, opt)
        for a, b in spec.parts:
            v = values.get((spec.name, a)) if values is not None else None
            if v is None or v.numel() != b - a:
                raise InvalidArgument(f"tensor {spec.name!r}: no initial values for part [{a}, {b})")
            info = PartInfo(spec.shape, a, b)
            w = v.to(torch.float32).reshape(info.shape).contiguous()
            entry.parts[a] = PartState(a, b, w, opt.init_state(w, info), info)
        return entry

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight.numel() * 4 for p in self.parts.values())

    @property
    def optimizer_state_bytes(self) -> int:
        return sum(state_bytes(p.state) for p in self.parts.values())


class TensorTable:
    """The tensors one shard holds, by name. Called under the store's lock (it has none of its own)."""

    def __init__(self, shard_index: int, entries: dict[str, TensorEntry] | None = None) -> None:
        self.shard_index = shard_index
        self.entries: dict[str, TensorEntry] = entries or {}

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def get(self, name: str) -> TensorEntry | None:
        return self.entries.get(name)

    def items(self) -> Iterator[tuple[str, TensorEntry]]:
        return iter(self.entries.items())

    def values(self) -> Iterator[TensorEntry]:
        return iter(self.entries.values())

    def spec(self, name: str) -> TensorSpec:
        """The registered spec of ``name``; NotFound if there is none."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(
                f"unknown tensor {name!r} on shard {self.shard_index} "
                f"({len(self.entries)} tensors registered)"
            )
        return entry.spec

    def part(self, name: str, start: int, numel: int) -> PartState:
        """The part of ``name`` at ``start`` for a gradient of ``numel`` elements (raises naming what is wrong)."""
        self.spec(name)
        part = self.entries[name].parts.get(start)
        if part is None:
            raise InvalidArgument(f"tensor {name!r}: shard {self.shard_index} owns no part at {start}")
        if numel != part.weight.numel():
            raise InvalidArgument(
                f"tensor {name!r}: gradient for part [{part.start}, {part.stop}) has "
                f"{numel} elements, expected {part.weight.numel()}"
            )
        return part

    def has_split(self) -> bool:
        return any(e.spec.split for e in self.entries.values())

    def split_names(self) -> list[str]:
        return [n for n, e in self.entries.items() if e.spec.split]

    @staticmethod
    def validate(specs: Sequence[TensorSpec], shard_index: int) -> None:
        """Each spec on its own, before any lock is taken."""
        for s in specs:
            s.validate()
            if s.split and shard_index not in s.holders:
                raise InvalidArgument(f"tensor {s.name!r}: shard {shard_index} is not among its "
                                      f"holders {list(s.holders)}")

    def new_entries(self, specs: Sequence[TensorSpec], values: dict[PartKey, torch.Tensor] | None, *,
                    replicated: bool, sync: SyncSpec | None, remedy: Remedy) -> list[TensorEntry]:
        """The entries to create for ``specs`` (not yet added); raises, changing nothing, if any is refused.

        Tensors already held must have an equal spec; tensors not yet held
        need ``values``.
        """
        for s in specs:
            if s.split and replicated:
                raise FailedPrecondition(
                    f"tensor {s.name!r} uses {s.optimizer.name}, whose statistics span the whole tensor, and is "
                    f"split across shards {list(s.holders)}: shards with a backup (--replicas 2) keep such "
                    f"tensors whole; pass a larger max_whole_bytes")
            if s.split and not (sync is not None and sync.barrier):
                raise FailedPrecondition(
                    f"tensor {s.name!r} uses {s.optimizer.name}, whose statistics span the whole tensor, "
                    f"and is split across shards {list(s.holders)}: that needs sync bsp or every:X, "
                    f"not {sync}; keep it whole (a larger max_whole_bytes) or change the sync mode"
                )
        if remedy.kind is RemedyKind.LR_SCALE:
            for s in specs:
                if not isinstance(getattr(s.optimizer, "lr", None), (int, float)):
                    raise FailedPrecondition(
                        f"tensor {s.name!r}: staleness remedy lr-scale needs an optimizer with a fixed lr; "
                        f"{s.optimizer.name} has lr={getattr(s.optimizer, 'lr', None)}"
                    )
        new = []
        for s in specs:
            entry = self.entries.get(s.name)
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
        return [TensorEntry.create(s, values) for s in new]

    def add(self, entries: Sequence[TensorEntry]) -> None:
        for e in entries:
            self.entries[e.spec.name] = e

    def replace(self, entries: dict[str, TensorEntry]) -> None:
        """Hold ``entries`` instead of every tensor now held (a restore). A Pull framing the old ones keeps them."""
        self.entries = entries

