"""Large and odd-sized tensors cross intact in chunks, in fp32, fp16 and bf16."""

import pytest
import torch

import shardps
from shardps.protos import codec


def test_64mb_and_odd_sized_tensors_round_trip_through_2_shards(cluster2):
    big = torch.randn(4096, 4096)  # 64 MiB of fp32
    odd = torch.randn(1_000_003)
    tiny = torch.randn(3, 7, 5)
    tensors = {"big": big, "odd": odd, "tiny": tiny}
    with shardps.connect(cluster2.addresses, part_bytes=8 << 20) as client:  # default client gRPC limits
        client.register(tensors, shardps.optim.SGD(lr=0.0), sync="asp")
        out = client.pull()
        # Both shards hold part of the big tensor, and each message stayed under a few MB.
        assert {p.server for p in client.shard_map.parts_of("big")} == {0, 1}
    for name, t in tensors.items():
        assert out[name].dtype == torch.float32
        assert torch.equal(out[name], t), name
    assert codec.DEFAULT_CHUNK_BYTES <= 4 << 20


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_payloads(cluster2, dtype):
    values = torch.randn(1001, 33).to(dtype)
    with shardps.connect(cluster2.addresses, part_bytes=4096, chunk_bytes=4096) as client:
        client.register({"w": values}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert torch.equal(client.pull()["w"], values)
        # Weights are fp32 on the servers: a pushed half gradient is applied in fp32.
        grad = torch.full_like(values, 0.5)
        client.push({"w": grad}, step=0)
        after = client.pull(min_versions=1)["w"]
        assert after.dtype == dtype
        expected = (values.float() - 0.5).to(dtype)
        assert torch.equal(after, expected)
        as32 = client.pull(dtype=torch.float32)["w"]
        torch.testing.assert_close(as32, values.float() - 0.5, rtol=0, atol=0)
        for store in cluster2.stores:
            for part in store.reader.weights("w").values():
                assert part.dtype == torch.float32
