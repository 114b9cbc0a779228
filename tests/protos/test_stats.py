"""ShardStats: one value for a shard's statistics, the same on the wire and in the CLI's shape."""

from __future__ import annotations

import torch

import shardps
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.stats import ShardStats
from shardps.server.store import ShardStore, TensorSpec


def _busy_store() -> ShardStore:
    st = ShardStore(1, 2, sync="asp", num_workers=3)
    st.path.register_tensors([TensorSpec("w", (2, 3), ps_pb2.FLOAT32, shardps.optim.Adam(lr=0.1), ((0, 6),)),
                         TensorSpec("b", (3,), ps_pb2.BFLOAT16, shardps.optim.SGD(lr=1.0), ((0, 3),))],
                        {("w", 0): torch.zeros(6), ("b", 0): torch.ones(3)})
    for w in range(3):
        st.leases.register(w)
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)}, 24)
    st.path.submit(1, 0, 0, {("b", 0): torch.ones(3)}, 12)
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)}, 24)  # a duplicate
    st.leases.leave(2)
    st.reader.read(["w", "b"], None)
    return st


def test_to_proto_and_back():
    s = _busy_store().stats()
    r = s.to_proto()
    assert r.version == 2 and r.duplicate_pushes_total == 1 and r.left_workers == [2]
    assert [t.spec.name for t in r.tensors] == ["b", "w"] and r.tensors[1].optimizer_state_bytes > 0
    back = ShardStats.from_proto(r)
    assert back.to_proto() == r
    # what the wire does not carry comes back empty; everything else is equal
    assert back.pulls_total == 0 and back.promotions_total == 0 and back.staleness_remedy == ""
    local = {k: v for k, v in vars(s).items() if k not in ("pulls_total", "promotions_total", "staleness_remedy")}
    assert local == {k: v for k, v in vars(back).items() if k in local}


def test_to_dict_is_the_clients_shape():
    d = ShardStats.from_proto(_busy_store().stats().to_proto()).to_dict()
    assert (d["shard_index"], d["num_shards"], d["sync"], d["version"]) == (1, 2, "asp", 2)
    assert d["tensors"][1] == {"name": "w", "shape": (2, 3), "dtype": "float32", "optimizer": "adam",
                               "parts": [(0, 6)], "weight_bytes": 24,
                               "optimizer_state_bytes": d["tensors"][1]["optimizer_state_bytes"]}
    assert d["duplicate_pushes_total"] == 1 and d["left_workers"] == [2] and d["worker_clocks"] == {0: 0, 1: 0}
    assert all(type(v) is int for v in d["staleness_counts"].values())
