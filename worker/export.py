"""Export: the weights and optimizer state of a running job, read from every shard (``PullState``).

What ``PSClient.export_state`` returns: a state_dict-style mapping built
from each shard's ``Operator.PullState`` stream (the operator token). Not
on the data path: each state tensor is allocated as it is announced and
filled chunk by chunk; a weight split over shards is put together whole,
optimizer state stays per part (factored state is sized by the part).
"""

from __future__ import annotations

from typing import Any

import torch

from shardps.protos import codec
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath.transport import Transport
from shardps.worker.layout import Layout

Item = tuple[str, int, int, str, torch.Tensor]  # (name, part start, part stop, key, values)


def export_state(transport: Transport, shard_map: ShardMap, layouts: dict[str, Layout], wanted: list[str],
                 chunk_bytes: int) -> dict[str, dict[str, Any]]:
    """``{name: {"weight": full fp32 tensor, "optimizer": {part_start: {key: tensor}}, "version": {shard: v}}}``
    for the registered tensors ``wanted``, read from their shards in parallel (each within the transport's
    deadline)."""
    owners: dict[int, list[str]] = {}
    for p in shard_map.parts:
        if p.name in wanted and p.name not in owners.setdefault(p.server, []):
            owners[p.server].append(p.name)

    def fetch(shard: int) -> tuple[int, list[Item]]:
        req = ps_pb2.PullStateRequest(names=owners[shard], chunk_bytes=chunk_bytes)
        items: list[Item] = []
        version = -1
        for r in transport.operator(shard).PullState(req, timeout=transport.timeout):
            c = r.chunk
            values = codec.decode(c.data, c.dtype)
            if c.offset == 0:  # the first chunk of a state tensor carries its shape
                items.append((r.name, r.part_start, r.part_stop, r.key,
                              torch.empty(tuple(r.shape), dtype=values.dtype)))
            dst = items[-1][4].view(-1)
            dst[c.offset : c.offset + values.numel()].copy_(values)
            version = r.version
        return version, items

    shards = sorted(owners)
    out: dict[str, dict[str, Any]] = {
        n: {"weight": torch.empty(layouts[n].shape, dtype=torch.float32), "optimizer": {}, "version": {}}
        for n in wanted
    }
    for shard, (version, items) in zip(shards, transport.each(fetch, shards)):
        for name, start, stop, key, t in items:
            entry = out[name]
            entry["version"][shard] = version
            if key == "weight":
                entry["weight"].view(-1)[start:stop].copy_(t.reshape(-1))
            else:
                entry["optimizer"].setdefault(start, {})[key] = t
    return out
