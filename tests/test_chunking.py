"""Large and odd-sized tensors cross intact in chunks, in fp32, fp16 and bf16."""

import grpc
import pytest
import torch

import shardps
from shardps.protos import codec, framing
from shardps.protos.shardps.v1 import ps_pb2


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


class _OneHeaders(grpc.ServerInterceptor):
    """Records, per call of ``method`` (Push or Pull) or of its unary twin (PushOne, PullOne), whether it was
    the twin and whether the shard's handler for it streams."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.seen: list[tuple[bool, bool]] = []

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        name = details.method.rsplit("/", 1)[-1]
        if name in (self.method, f"{self.method}One"):
            self.seen.append((name.endswith("One"), handler.request_streaming or handler.response_streaming))
        return handler


def _one_shard(make_cluster, headers: _OneHeaders, lr: float,
               monkeypatch: pytest.MonkeyPatch) -> tuple[shardps.PSClient, torch.Tensor]:
    """One shard recording ``headers``, and a client over gRPC (no shared memory, no TCP path: the bytes in
    the messages) with one tensor of 4000 bytes registered: one message in 4096-byte chunks (the client's),
    two in 2048."""
    monkeypatch.setenv("SHARDPS_TCP", "0")
    cluster = make_cluster(1, interceptors=[headers])
    w = torch.randn(1000)
    client = shardps.connect(cluster.addresses, chunk_bytes=4096, shm=False)
    client.register({"w": w}, shardps.optim.SGD(lr=lr), sync="asp")
    return client, w


def test_a_one_message_pull_is_a_unary_call_and_a_refused_one_is_asked_again_as_a_stream(make_cluster, monkeypatch):
    headers = _OneHeaders("Pull")
    client, w = _one_shard(make_cluster, headers, 0.0, monkeypatch)
    with client:
        assert torch.equal(client.pull()["w"], w)
        assert torch.equal(client.pull(dtype=torch.float16)["w"], w.half())
        client.chunk_bytes = 2048
        assert torch.equal(client.pull()["w"], w)
        assert headers.seen == [(True, False), (True, False), (False, True)]  # (PullOne, a stream): one when it is
        t = client.transport
        two = ps_pb2.PullRequest(names=["w"], chunk_bytes=2048)
        with pytest.raises(grpc.RpcError) as refused:  # asked as one, the shard has two
            t._pull_one[0](two, timeout=5)
        assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "2 messages, not one" in refused.value.details()
        got = list(t.pull(0, two, one=True))  # the transport then asks for the stream
        assert [r.chunk.offset for r in got] == [0, 512]
        assert torch.equal(torch.cat([codec.decode(r.chunk.data, r.chunk.dtype) for r in got]), w)


def test_a_one_message_push_is_read_whole_and_a_stream_of_one_is_still_taken(make_cluster, monkeypatch):
    headers = _OneHeaders("Push")
    client, w = _one_shard(make_cluster, headers, 1.0, monkeypatch)
    with client:
        client.push({"w": torch.ones(1000)}, step=0)  # one message: a unary call, the shard's unary handler
        client.chunk_bytes = 2048
        client.push({"w": torch.ones(1000)}, step=1)  # two: a stream
        assert headers.seen == [(True, False), (False, True)]  # (PushOne, read as a stream)
        # A worker that sends one message as a stream (Push, not PushOne) is answered as before.
        prefix, suffix = framing.header(ps_pb2.PushRequest, worker_id=0, step=2, base_version=0,
                                        epoch=client.epoch, ends_with_last=True, last=True)
        (_, _, msg), = framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, "w", ps_pb2.FLOAT32,
                                              (1000,), torch.ones(1000), 0, 1000, 4096)
        answer = client.transport._push_raw[0](iter([msg]), timeout=5)
        assert answer.version == 3 and headers.seen[-1] == (False, True)
        # Bad input through the unary handler: a clear status, and nothing changes.
        with pytest.raises(shardps.ShardError) as bad:
            client.push({"w": torch.ones(1000)}, step=7)
        assert bad.value.code == grpc.StatusCode.FAILED_PRECONDITION and "step 7" in bad.value.details
        prefix, suffix = framing.header(ps_pb2.PushRequest, worker_id=0, step=3, base_version=0,
                                        epoch=client.epoch, ends_with_last=True, last=True)
        (_, _, msg), = framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, "nope", ps_pb2.FLOAT32,
                                              (1000,), torch.ones(1000), 0, 1000, 4096)
        with pytest.raises(grpc.RpcError) as unknown:
            client.transport._push_one[0](msg, timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details()
        assert headers.seen[-1] == (True, False)
        assert torch.equal(client.pull()["w"], w - 1 - 1 - 1)  # three steps of lr 1, each once
        assert client.versions == [3]
