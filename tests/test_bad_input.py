"""Bad requests get a status code and a message naming what was wrong, and change nothing."""

from __future__ import annotations

import grpc
import pytest
import torch

import shardps
import shardps.server.errors
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.testing.frames import FrameStub


@pytest.fixture
def setup(make_cluster):
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=2)
    client.register({"w": torch.randn(4, 5), "b": torch.randn(5)}, shardps.optim.Adam(), sync="bsp")
    stub = FrameStub(cluster.addresses[0])  # Push as a data connection's frames, the rest over gRPC
    yield cluster.stores[0], stub, client
    stub.close()
    client.close()


def chunk(name="w", offset=0, n=20, dtype=ps_pb2.FLOAT32, shape=(4, 5), data=None):
    if data is None:
        t = {ps_pb2.FLOAT32: torch.float32, ps_pb2.FLOAT16: torch.float16, ps_pb2.BFLOAT16: torch.bfloat16}[dtype]
        data = torch.ones(n, dtype=t).view(torch.uint8).numpy().tobytes()
    return ps_pb2.Chunk(name=name, offset=offset, dtype=dtype, data=data, shape=list(shape))


def push(stub, *chunks, worker_id=0, step=0, base_version=0):
    reqs = [ps_pb2.PushRequest(worker_id=worker_id, step=step, base_version=base_version, chunk=c) for c in chunks]
    return stub.Push(iter(reqs), timeout=10)


BAD_PUSHES = {
    "wrong shape": (dict(chunks=[chunk(shape=(5, 4))]), grpc.StatusCode.INVALID_ARGUMENT,
                    ["'w'", "expected (4, 5)", "got (5, 4)"]),
    "wrong dtype": (dict(chunks=[chunk(dtype=ps_pb2.FLOAT16)]), grpc.StatusCode.INVALID_ARGUMENT,
                    ["'w'", "expected float32", "got float16"]),
    "unknown tensor": (dict(chunks=[chunk(name="nope")]), grpc.StatusCode.NOT_FOUND, ["'nope'"]),
    "offset out of range": (dict(chunks=[chunk(offset=15, n=10)]), grpc.StatusCode.INVALID_ARGUMENT,
                            ["'w'", "[15, 25)", "out of range", "20 elements"]),
    "negative offset": (dict(chunks=[chunk(offset=-3, n=5)]), grpc.StatusCode.INVALID_ARGUMENT, ["'w'", "[-3, 2)"]),
    "unregistered worker": (dict(chunks=[chunk()], worker_id=1), grpc.StatusCode.FAILED_PRECONDITION,
                            ["worker 1 is not registered", "registered: [0]"]),
    "worker id out of range": (dict(chunks=[chunk()], worker_id=7), grpc.StatusCode.FAILED_PRECONDITION,
                               ["worker 7 is not registered"]),
    "bytes not a whole element": (dict(chunks=[chunk(data=b"\x00" * 6)]), grpc.StatusCode.INVALID_ARGUMENT,
                                  ["'w'", "6 bytes", "float32"]),
    "partial tensor": (dict(chunks=[chunk(n=12)]), grpc.StatusCode.INVALID_ARGUMENT,
                       ["'w'", "covers 12 of the 20 elements"]),
    "overlapping chunks": (dict(chunks=[chunk(n=12), chunk(offset=8, n=12, shape=())]),
                           grpc.StatusCode.INVALID_ARGUMENT, ["'w'", "overlapping"]),
    "valid chunk then a bad one": (dict(chunks=[chunk(), chunk(name="b", n=5, shape=(6,))]),
                                   grpc.StatusCode.INVALID_ARGUMENT, ["'b'", "expected (5,)", "got (6,)"]),
    "base version from the future": (dict(chunks=[chunk()], base_version=9), grpc.StatusCode.INVALID_ARGUMENT,
                                     ["base_version 9", "version 0"]),
    "step from the future": (dict(chunks=[chunk()], step=5), grpc.StatusCode.FAILED_PRECONDITION,
                             ["worker 0 pushed step 5", "last step on shard 0 was -1", "steps go up by one"]),
    "negative step": (dict(chunks=[chunk()], step=-1), grpc.StatusCode.INVALID_ARGUMENT, ["step must be >= 0"]),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_is_refused_and_changes_nothing(setup, case):
    store, stub, _ = setup
    kwargs, code, fragments = BAD_PUSHES[case]
    before = store.state_hash()
    counters = (store.job.version, store.job.pushes_total, store.applier.applied_updates_total,
                dict(store.job.worker_clocks))
    with pytest.raises(grpc.RpcError) as err:
        push(stub, *kwargs.pop("chunks"), **kwargs)
    assert err.value.code() == code, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())
    assert store.state_hash() == before
    assert (store.job.version, store.job.pushes_total, store.applier.applied_updates_total,
            dict(store.job.worker_clocks)) == counters


def test_mixed_headers_in_one_stream_are_refused(setup):
    store, stub, _ = setup
    before = store.state_hash()
    reqs = [ps_pb2.PushRequest(worker_id=0, step=0, chunk=chunk(n=10)),
            ps_pb2.PushRequest(worker_id=0, step=1, chunk=chunk(offset=10, n=10))]
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter(reqs), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mixes headers" in err.value.details()
    assert store.state_hash() == before


@pytest.mark.cluster
def test_registering_a_different_spec_is_refused(setup):
    store, _, client = setup
    before = store.state_hash()
    with shardps.connect(client.addresses, worker_id=0, num_workers=2) as other:
        with pytest.raises(shardps.ShardError) as err:
            other.register({"w": torch.randn(5, 4), "b": torch.randn(5)}, shardps.optim.Adam(), sync="bsp")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "'w'" in err.value.details and "shape (4, 5) vs (5, 4)" in err.value.details
        with pytest.raises(shardps.ShardError) as err:
            other.register({"w": torch.randn(4, 5), "b": torch.randn(5)}, shardps.optim.SGD(), sync="bsp")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "optimizer" in err.value.details
        with shardps.connect(client.addresses, worker_id=0, num_workers=3) as third:
            with pytest.raises(shardps.ShardError) as err:
                third.register({"w": torch.randn(4, 5), "b": torch.randn(5)}, shardps.optim.Adam(), sync="bsp")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "num_workers=2" in err.value.details
        # A worker asking for another sync mode joins the job's (which may have been switched).
        other.register({"w": torch.randn(4, 5), "b": torch.randn(5)}, shardps.optim.Adam(), sync="asp")
        assert other.sync == "bsp"
        # The same spec again is fine (idempotent) and keeps the weights.
        assert other.register({"w": torch.zeros(4, 5), "b": torch.zeros(5)}, shardps.optim.Adam(), sync="bsp") == []
    assert store.state_hash() == before


def test_pull_errors(setup):
    store, stub, _ = setup
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(ps_pb2.PullRequest(names=["w", "ghost"]), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'ghost'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(ps_pb2.PullRequest(names=["w"], dtype=7), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "7" in err.value.details()
    # A version that will not come: the deadline is honoured and the message says who is missing.
    push(stub, chunk(), chunk(name="b", n=5, shape=(5,)))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(ps_pb2.PullRequest(names=["w"], min_version=1), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_barrier_wait_names_missing_workers(setup):
    store, stub, _ = setup
    push(stub, chunk(), chunk(name="b", n=5, shape=(5,)))
    with pytest.raises(shardps.server.errors.DeadlineExceeded,
                       match=r"waited 0.1s for version 1: round 0 has gradients from workers \[0\], missing \[1\]"):
        store.job.wait_version(1, timeout=0.1)


def test_duplicate_push_is_acknowledged_once(setup):
    store, stub, _ = setup
    r1 = push(stub, chunk(), chunk(name="b", n=5, shape=(5,)))
    before = store.state_hash()
    r2 = push(stub, chunk(), chunk(name="b", n=5, shape=(5,)))
    assert not r1.duplicate and r2.duplicate
    assert store.state_hash() == before and store.job.pushes_total == 2 and store.job.duplicate_pushes_total == 1


def test_non_finite_gradient_not_flagged_by_the_worker_is_caught_and_the_step_skipped(make_cluster):
    cluster = make_cluster(1)
    store = cluster.stores[0]
    bad = torch.ones(6)
    bad[3] = float("nan")
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1) as client, \
            FrameStub(cluster.addresses[0]) as stub:
        client.register({"w": torch.ones(6)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        r = push(stub, chunk(n=6, shape=(6,), data=bad.numpy().tobytes()))  # found_inf not set
    assert r.version == 1 and not r.applied
    assert store.applier.skipped_steps_total == 1 and torch.equal(store.reader.weights("w")[0], torch.ones(6))


def test_shapes_beyond_int64_element_counts_are_refused(make_cluster):
    # Found by the fuzzer: (2**62, 2**62) with a one-element part used to be accepted.
    cluster = make_cluster(1)
    with grpc.insecure_channel(cluster.addresses[0]) as ch:
        stub = ps_pb2_grpc.WorkersStub(ch)
        spec = ps_pb2.TensorSpec(name="huge", shape=[2**62, 2**62], dtype=ps_pb2.FLOAT32,
                                 optimizer=shardps.optim.SGD().to_proto(), parts=[ps_pb2.Part(start=0, stop=1)])
        req = ps_pb2.RegisterRequest(worker_id=0, num_workers=1, sync="asp", tensors=[spec], provides_values=True,
                                     chunk=ps_pb2.Chunk(name="huge", offset=0, dtype=ps_pb2.FLOAT32, data=b"\0" * 4))
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(iter([req]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'huge'" in err.value.details()
    assert cluster.stores[0].names() == []
