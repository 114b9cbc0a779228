"""Layouts without a network: the plan, the Register stream it makes, and the same layouts read back."""

from __future__ import annotations

import torch

from shardps.protos import codec
from shardps.protos.optim import SGD, Adafactor
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.layout import Layout, from_stats, plan, register_requests

TENSORS = {"w": torch.arange(600, dtype=torch.float32).view(20, 30), "b": torch.zeros(7), "e": torch.zeros(0)}


def _choose(name: str, t: torch.Tensor):
    return Adafactor() if name == "w" else SGD(lr=0.5)


def test_plan_gives_every_tensor_a_layout_and_parts_to_the_non_empty():
    layouts, smap = plan(TENSORS, _choose, 2, grad_dtype=torch.bfloat16, part_bytes=512)
    assert layouts["w"] == Layout((20, 30), codec.to_wire_dtype(torch.float32), Adafactor(),
                                  codec.to_wire_dtype(torch.bfloat16))
    assert layouts["w"].push_dtype == codec.to_wire_dtype(torch.bfloat16) and layouts["w"].numel == 600
    assert layouts["e"].numel == 0 and not smap.parts_of("e")
    assert {p.name for p in smap.parts} == {"w", "b"}
    same, _ = plan(TENSORS, _choose, 2, grad_dtype=torch.float32)
    assert same["b"].grad_dtype == 0  # the wire dtype already: no separate gradient dtype


def test_register_stream_then_stats_give_back_the_same_layouts():
    layouts, smap = plan(TENSORS, _choose, 2, part_bytes=512)
    flats = {n: t.view(-1) for n, t in TENSORS.items()}
    stats = []
    for shard in range(2):
        msgs = list(register_requests(shard, smap, layouts, worker_id=0, num_workers=3, sync="bsp",
                                      addresses=["a:1", "b:1"], values=flats, chunk_bytes=64))
        head, chunks = msgs[0], msgs[1:]
        assert (head.worker_id, head.num_workers, head.sync, head.provides_values) == (0, 3, "bsp", True)
        got = {}
        for m in chunks:
            got.setdefault(m.chunk.name, 0)
            got[m.chunk.name] += len(m.chunk.data) // 4
        assert got == {n: sum(p.stop - p.start for p in smap.parts_for(shard) if p.name == n) for n in got}
        stats.append(ps_pb2.StatsResponse(tensors=[ps_pb2.TensorStats(spec=s) for s in head.tensors]))
    back, back_map = from_stats(stats)
    assert back == {n: lay for n, lay in layouts.items() if n != "e"}
    assert back_map.parts == smap.parts


def test_a_worker_without_values_sends_the_specs_only():
    layouts, smap = plan(TENSORS, SGD(), 1)
    msgs = list(register_requests(0, smap, layouts, worker_id=1, num_workers=2, sync="asp", addresses=["a:1"],
                                  values=None, chunk_bytes=1 << 20))
    assert len(msgs) == 1 and not msgs[0].provides_values and len(msgs[0].tensors) == 2
