"""ShardStats: one value for a shard's statistics, the same on the wire and in the CLI's shape."""

from __future__ import annotations

import torch

import shardps
from shardps.admin import stats_to_dict
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.stats import ShardStats
from shardps.server.store import ShardStore, TensorSpec


def _busy_store() -> ShardStore:
    st = ShardStore(1, 2, sync="asp", num_workers=3)
    st.register_tensors([TensorSpec("w", (2, 3), ps_pb2.FLOAT32, shardps.optim.Adam(lr=0.1), ((0, 6),)),
                         TensorSpec("b", (3,), ps_pb2.BFLOAT16, shardps.optim.SGD(lr=1.0), ((0, 3),))],
                        {("w", 0): torch.zeros(6), ("b", 0): torch.ones(3)})
    for w in range(3):
        st.register_worker(w)
    st.submit(0, 0, 0, {("w", 0): torch.ones(6)}, 24)
    st.submit(1, 0, 0, {("b", 0): torch.ones(3)}, 12)
    st.submit(0, 0, 0, {("w", 0): torch.ones(6)}, 24)  # a duplicate
    st.leave(2)
    st.read(["w", "b"], None)
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
    r = ShardStats.from_proto(_busy_store().stats().to_proto()).to_proto()
    assert ShardStats.from_proto(r).to_dict() == stats_to_dict(r)
    assert list(ShardStats.from_proto(r).to_dict()) == list(stats_to_dict(r))
