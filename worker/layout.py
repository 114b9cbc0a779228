"""Layouts: how each tensor travels (shape, wire dtypes, optimizer) and which shard holds which part.

``plan`` computes them for a worker registering its tensors (the shard map
is a pure function of the tensors, so every worker computes the same);
``register_requests`` is what a shard is sent to register its parts (and,
from the worker that provides values, their initial values); ``from_stats``
reads them back from the shards (a client that attaches instead).
``check_shard_order`` and ``addresses_and_backups``: where the shards are,
as given or from the environment, and that each is the shard it is named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardps.protos import codec, env
from shardps.protos.optim import OptimizerSpec, spec_from_proto
from shardps.protos.shardmap import Part, ShardMap, TensorInfo, build_shard_map
from shardps.protos.shardps.v1 import ps_pb2

DEFAULT_MAX_WHOLE_BYTES = 256 << 20

OptimizerChoice = OptimizerSpec | Callable[[str, torch.Tensor], OptimizerSpec]


@dataclass(frozen=True)
class Layout:
    """How a tensor travels: full shape, wire dtype, optimizer, gradient dtype."""

    shape: tuple[int, ...]
    dtype: int
    optimizer: OptimizerSpec
    grad_dtype: int = 0  # 0: the same as dtype

    @property
    def push_dtype(self) -> int:
        return self.grad_dtype or self.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan(tensors: Mapping[str, torch.Tensor], optimizer: OptimizerChoice, num_shards: int, *,
         grad_dtype: torch.dtype | None = None, part_bytes: int | None = None,
         max_whole_bytes: int = DEFAULT_MAX_WHOLE_BYTES,
         plan_over: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, Layout], ShardMap]:
    """Each tensor's layout and the shard map of their parts (empty tensors have a layout, no part).
    ``plan_over``: a superset of ``tensors`` (shapes and dtypes: "meta" tensors do) whose shard map is
    planned, then kept to ``tensors``' parts, so that a tensor's place does not depend on which others
    this worker registers (a TP rank's owned tensors: worker/tp/servers.py)."""
    if plan_over is not None:
        missing = [n for n in tensors if n not in plan_over]
        if missing:
            raise ValueError(f"plan_over lacks the registered tensors {missing[:3]}")
        every, smap = plan(plan_over, optimizer, num_shards, grad_dtype=grad_dtype, part_bytes=part_bytes,
                           max_whole_bytes=max_whole_bytes)
        return ({n: every[n] for n in tensors},
                ShardMap(smap.num_servers, tuple(p for p in smap.parts if p.name in tensors),
                         tuple(t for t in smap.tensors if t.name in tensors)))
    gwire = codec.to_wire_dtype(grad_dtype) if grad_dtype is not None else 0
    layouts: dict[str, Layout] = {}
    infos = []
    for name, t in tensors.items():
        opt = optimizer(name, t) if callable(optimizer) else optimizer
        wire = codec.to_wire_dtype(t.dtype)
        layouts[name] = Layout(tuple(t.shape), wire, opt, gwire if gwire != wire else 0)
        if t.numel() == 0:
            continue
        infos.append(TensorInfo(name, tuple(t.shape), t.element_size(), opt.elementwise))
    smap = build_shard_map(infos, num_shards, part_bytes=part_bytes, max_whole_bytes=max_whole_bytes)
    return layouts, smap


def register_requests(shard: int, smap: ShardMap, layouts: Mapping[str, Layout], *, worker_id: int,
                      num_workers: int, sync: str, addresses: Sequence[str],
                      values: Mapping[str, torch.Tensor] | None, chunk_bytes: int,
                      loss_scaling: ps_pb2.LossScaling | None = None,
                      staleness_remedy: str = "none", shm_probe: str = "",
                      shm_token: bytes = b"") -> Iterator[ps_pb2.RegisterRequest]:
    """The Register stream for ``shard``: its parts' specs, then (``values``: flat CPU tensors) their values."""
    parts = smap.parts_for(shard)
    by_name: dict[str, list[tuple[int, int]]] = {}
    for p in parts:
        by_name.setdefault(p.name, []).append((p.start, p.stop))
    specs = []
    for n, rs in by_name.items():
        lay = layouts[n]
        holders = smap.holders(n)
        specs.append(ps_pb2.TensorSpec(
            name=n, shape=list(lay.shape), dtype=lay.dtype, grad_dtype=lay.push_dtype,  # type: ignore[arg-type]
            optimizer=lay.optimizer.to_proto(), parts=[ps_pb2.Part(start=a, stop=b) for a, b in rs],
            peers=addresses if holders else [], holders=holders))
    provides_values = values is not None
    yield ps_pb2.RegisterRequest(worker_id=worker_id, num_workers=num_workers,
                                 sync=sync, tensors=specs, provides_values=provides_values,
                                 loss_scaling=loss_scaling, staleness_remedy=staleness_remedy,
                                 shm_probe=shm_probe, shm_token=shm_token)
    if values is not None:
        for p in parts:
            flat = values[p.name]
            for off, data in codec.encode_range(flat, p.start, p.stop, chunk_bytes):
                yield ps_pb2.RegisterRequest(chunk=ps_pb2.Chunk(
                    name=p.name, offset=off, dtype=layouts[p.name].dtype, data=data))  # type: ignore[arg-type]


def from_stats(stats: Sequence[ps_pb2.StatsResponse]) -> tuple[dict[str, Layout], ShardMap]:
    """The layouts and shard map the shards hold, from their Stats (in shard order)."""
    parts: list[Part] = []
    layouts: dict[str, Layout] = {}
    for i, s in enumerate(stats):
        for held in s.tensors:
            spec = held.spec
            gd = spec.grad_dtype if spec.grad_dtype != spec.dtype else 0
            layouts[spec.name] = Layout(tuple(spec.shape), spec.dtype, spec_from_proto(spec.optimizer), gd)
            parts.extend(Part(spec.name, p.start, p.stop, i) for p in spec.parts)
    infos = tuple(TensorInfo(n, lay.shape, codec.itemsize(lay.dtype)) for n, lay in sorted(layouts.items()))
    smap = ShardMap(len(stats), tuple(sorted(parts, key=lambda p: (p.name, p.start))), infos)
    return layouts, smap


def check_shard_order(responses: Sequence[Any], addresses: Sequence[str]) -> None:
    """ValueError unless the server at ``addresses[i]`` answered Register as shard i of len(addresses)."""
    for i, r in enumerate(responses):
        if (r.shard_index, r.num_shards) != (i, len(addresses)):
            raise ValueError(f"server {addresses[i]} is shard {r.shard_index} of {r.num_shards}, but was given as "
                             f"shard {i} of {len(addresses)}: list addresses in shard order")


def addresses_and_backups(addresses: Sequence[str] | str | None, backups: Sequence[str] | str | None
                          ) -> tuple[list[str], list[str] | None]:
    """``connect``'s shard addresses and backups: as given (a comma-separated string works), else from
    ``SHARDPS_ADDRESSES`` (then the backups from ``SHARDPS_BACKUPS``: those of these shards)."""
    from_env = addresses is None
    if addresses is None:
        addresses = env.get_list(env.ADDRESSES)
        if addresses is None:
            raise ValueError(f"no server addresses: pass addresses= or set {env.ADDRESSES}=HOST:PORT,...")
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",") if a.strip()]
    if backups is None and from_env:  # the backups of those shards, not of shards passed here
        backups = env.get_list(env.BACKUPS)
    if isinstance(backups, str):
        backups = [a.strip() for a in backups.split(",")]
    return list(addresses), list(backups) if backups is not None else None
