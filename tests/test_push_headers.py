"""A stream whose messages disagree is refused whole, on every path a shard reads one, and changes nothing.

Regression tests for 2026-12-01 (the fuzzer, seeds the suite had never
run): a Push whose later message said found_inf where its first did not was
applied as one step, and a state change it made was blamed on the malformed
stream before it. Every path that reads a Push (a frame of many messages or
of one, the same-host path through shared memory), a Register stream, and
an op replicated to a backup share one check (server/datapath/headers.py); each
path is tried here as the shard receives it (Push as a data connection's
frames, the others over gRPC). The checks themselves: tests/server/test_wire.py
and tests/server/test_replica.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch

import shardps
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.testing import fuzz
from shardps.testing.frames import FrameStub

W = torch.arange(20, dtype=torch.float32).reshape(4, 5)


@pytest.fixture
def one_shard(make_cluster):
    """One shard, one worker registered (on this host: its shared-memory segments work), bsp."""
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses)
    client.register({"w": W.clone()}, shardps.optim.SGD(lr=0.5), sync="bsp")
    channel = grpc.insecure_channel(cluster.addresses[0])
    yield cluster, channel, client
    channel.close()
    client.close()


def chunk(offset: int, n: int, value: float = 1.0) -> ps_pb2.Chunk:
    data = torch.full((n,), value).numpy().tobytes()
    return ps_pb2.Chunk(name="w", offset=offset, dtype=ps_pb2.FLOAT32, data=data, shape=[4, 5])


def refused(call, stores, fragments) -> None:
    before = fuzz.local_state(stores)
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())
    assert fuzz.local_state(stores) == before


def test_a_streamed_push_whose_found_inf_disagrees_is_refused(one_shard):
    cluster, channel, _ = one_shard
    stub = FrameStub(cluster.addresses[0])
    head = dict(worker_id=0, step=0, base_version=0)
    msgs = [ps_pb2.PushRequest(**head, chunk=chunk(0, 10)), ps_pb2.PushRequest(**head, chunk=chunk(10, 10)),
            ps_pb2.PushRequest(**head, found_inf=True)]
    refused(lambda: stub.Push(iter(msgs), timeout=10), cluster.stores,
            ["Push stream mixes headers", "message 3 has found_inf True, the first message False"])
    # The worker's own framing: the last message of a stream that ends_with_last raises it. Taken (a skipped step).
    for m in msgs:
        m.ends_with_last = True
    msgs[-1].last = True
    answer = stub.Push(iter(msgs), timeout=10)
    store = cluster.stores[0]
    assert answer.version == 1 and store.job.worker_clocks[0] == 0 and store.applier.applied_updates_total == 0
    assert torch.equal(fuzz.pull_all(cluster.addresses)["w"], W)


def test_a_push_of_one_message_is_refused_as_a_stream_is(one_shard):
    """A Push frame of one message: the same check."""
    cluster, _, _ = one_shard
    stub = FrameStub(cluster.addresses[0])
    cut = ps_pb2.PushRequest(worker_id=0, step=0, chunk=chunk(0, 20), ends_with_last=True)  # no last: cut
    refused(lambda: stub.Push([cut], timeout=10), cluster.stores, ["ended before its last message"])
    refused(lambda: stub.Push([b"\xff"], timeout=10), cluster.stores, ["does not parse"])
    whole = ps_pb2.PushRequest(worker_id=0, step=0, chunk=chunk(0, 20), ends_with_last=True, last=True)
    assert stub.Push([whole], timeout=10).applied
    stub.close()


def test_a_push_through_shared_memory_whose_messages_disagree_is_refused(one_shard):
    cluster, channel, client = one_shard
    link = client.shm_links[0]
    assert link is not None, "the worker shares this host with its shard: the fast path is on"
    stub = FrameStub(cluster.addresses[0])

    def msg(offset: int, **kw) -> ps_pb2.PushRequest:
        c = ps_pb2.Chunk(name="w", offset=offset, dtype=ps_pb2.FLOAT32, shape=[4, 5], shm_offset=offset * 4,
                         shm_bytes=40)
        return ps_pb2.PushRequest(worker_id=0, step=0, shm=link.push.name, chunk=c, **kw)

    refused(lambda: stub.Push(iter([msg(0), msg(10, found_inf=True)]), timeout=10), cluster.stores,
            ["message 2 has found_inf True, the first message False"])
    refused(lambda: stub.Push(iter([msg(0), msg(10, base_version=1)]), timeout=10), cluster.stores,
            ["message 2 has base_version 1, the first message 0"])
    assert stub.Push(iter([msg(0), msg(10)]), timeout=10).applied  # agreed: taken


def test_a_register_stream_whose_messages_disagree_or_do_not_parse_is_refused(one_shard):
    cluster, channel, _ = one_shard
    spec = ps_pb2.TensorSpec(name="v", shape=[4], dtype=ps_pb2.FLOAT32, parts=[ps_pb2.Part(start=0, stop=4)],
                             optimizer=ps_pb2.OptimizerSpec(name="sgd", params_json='{"lr": 0.1}'))
    first = ps_pb2.RegisterRequest(worker_id=0, num_workers=1, sync="bsp", tensors=[spec], provides_values=True,
                                   chunk=ps_pb2.Chunk(name="v", offset=0, dtype=ps_pb2.FLOAT32,
                                                      data=torch.zeros(2).numpy().tobytes()))
    rest = ps_pb2.RegisterRequest(sync="asp", chunk=ps_pb2.Chunk(name="v", offset=2, dtype=ps_pb2.FLOAT32,
                                                                  data=torch.zeros(2).numpy().tobytes()))
    stub = ps_pb2_grpc.WorkersStub(channel)
    refused(lambda: stub.Register(iter([first, rest]), timeout=10), cluster.stores,
            ["Register stream mixes headers: message 2 has sync 'asp', the first message 'bsp'"])
    raw = channel.stream_unary(fuzz.method_path("Register"))
    rest.ClearField("sync")
    refused(lambda: raw(iter([first.SerializeToString(), b"\xff", rest.SerializeToString()]), timeout=10),
            cluster.stores, ["does not parse"])
    assert [t.name for t in cluster.stores[0].stats().tensors] == ["w"]


def test_an_op_replicated_to_a_backup_whose_messages_disagree_or_do_not_parse_is_refused(make_cluster):
    cluster = make_cluster(2, replicas=2)
    with shardps.connect(cluster.addresses, num_workers=1) as client:
        client.register({"w": W.clone()}, shardps.optim.SGD(lr=0.5), sync="bsp")
        backups = cluster.backups
        head = ps_pb2.ReplicateRequest(seq=1 << 40, op="submit", args_json='{"_layout": [["w@0", "float32", [2], 0]], '
                                       '"_nbytes": 8}', shard_index=backups[0].shard_index, num_shards=2,
                                       tensors=b"\0" * 4)
        rest = ps_pb2.ReplicateRequest(seq=1 << 40, op="evict", tensors=b"\0" * 4)
        with grpc.insecure_channel(cluster.backup_addresses[backups[0].shard_index]) as ch:
            replicate = ch.stream_unary(fuzz.method_path("Replicate"))
            refused(lambda: replicate(iter([head.SerializeToString(), rest.SerializeToString()]), timeout=10),
                    backups, ["Replicate stream mixes headers: message 2 has op 'evict', the first message 'submit'"])
            rest.ClearField("op")
            refused(lambda: replicate(iter([head.SerializeToString(), b"\xff", rest.SerializeToString()]),
                                      timeout=10), backups, ["does not parse"])
        # The backups took nothing in and are still in step: the next real step reaches them.
        client.push({"w": torch.ones(4, 5)}, step=0)
    for store in cluster.stores:
        store.replica.replicated()
        backup = next(b for b in backups if b.shard_index == store.shard_index)
        assert backup.state_hash() == store.state_hash() and store.job.version == 1
