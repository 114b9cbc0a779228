"""Sliced pushes (PushRequest.slices, server/datapath/slicepush.py): each worker of a TP group pushes its slice of a
gradient.

Real servers on loopback, the workers threads. 2 data-parallel replicas x 2 slices (4 workers) pushing the
slices of each replica's gradient give, step after step under Adam, the very weights 2 workers pushing the
whole gradients give (bit for bit), along dims 0, 1 and 2 and with blocks; bad slices are INVALID_ARGUMENT
naming the tensor, the expected and the received, and change nothing; asp refuses slices.
"""

from __future__ import annotations

import grpc
import pytest
import torch

import shardps
from shardps.protos import codec
from shardps.protos import dataconn as wire
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.testing.frames import FrameStub
from shardps.worker.datapath.dataconn import DataConn
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.slicepush import push_slices
from tests.helpers import run_workers
from tests.replicas import same_state
from tests.test_slice_pull import _expected, _tensors

pytestmark = pytest.mark.cluster

ADAM = shardps.optim.Adam(lr=1e-2)
REPLICAS, P, STEPS = 2, 2, 4
CUTS = {"w": (1, 1), "v": (0, 1), "qkv": (0, 3), "t": (2, 1)}  # name: (dim, blocks); "s" (0-d) goes whole


def _grad(name: str, shape: torch.Size, replica: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + sorted(_tensors()).index(name))
    return torch.randn(shape, generator=g)


def _train(addresses: list[str], sliced: bool, shm: bool = True) -> list[dict[str, torch.Tensor]]:
    """The servers' weights after each step: REPLICAS workers pushing whole gradients, or REPLICAS x P
    workers (worker r * P + t) pushing rank t's slice of replica r's (the 0-d one whole, by rank 0).
    ``shm``: the same-host path on (the bytes in the shards' segments), or off (in the frames)."""
    values = _tensors()
    n = REPLICAS * P if sliced else REPLICAS

    def worker(k: int) -> list[dict[str, torch.Tensor]]:
        r, t = divmod(k, P) if sliced else (k, 0)
        seen = []
        with shardps.connect(addresses, worker_id=k, num_workers=n, part_bytes=64, shm=shm) as client:
            client.register(values, ADAM)
            for step in range(STEPS):
                grads = {name: _grad(name, v.shape, r, step) for name, v in values.items()}
                if sliced:
                    slices = {name: TensorSlice(d, P, t, b) for name, (d, b) in CUTS.items()}
                    mine = {name: _expected(g, slices[name]) for name, g in grads.items() if name in slices}
                    if t == 0:
                        mine["s"] = grads["s"]
                    out = push_slices(client, mine, slices, step, client.versions)
                else:
                    out = client.push(grads, step)
                seen.append(client.pull(min_versions=[x.ready_version for x in out]))
        return seen

    return run_workers(worker, n, timeout=120)[0]


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_slices_of_two_replicas_step_as_their_whole_gradients_do_bit_for_bit(make_cluster, monkeypatch,
                                                                            shm: bool) -> None:
    """The slices' bytes go where a push's go: the shards' segments, or the frames' extents, sent from the
    slices' memory; never in the messages."""
    whole = _train(make_cluster(2).addresses, sliced=False, shm=shm)
    inline, extents = [], []
    chunks, send = PushFramer.chunks, DataConn._send

    def counted_chunks(self, *args, **kw):  # type: ignore[no-untyped-def]
        inline.append(args[0])
        return chunks(self, *args, **kw)

    def counted_send(self, kind, call, route, ctl, ext, *args, **kw):  # type: ignore[no-untyped-def]
        if kind in (wire.PUSH, wire.PUSH_PULL):
            extents.append(sum(memoryview(b).nbytes for _, b in ext))
        return send(self, kind, call, route, ctl, ext, *args, **kw)

    monkeypatch.setattr(PushFramer, "chunks", counted_chunks)
    monkeypatch.setattr(DataConn, "_send", counted_send)
    sliced = _train(make_cluster(2).addresses, sliced=True, shm=shm)
    monkeypatch.undo()
    assert inline == []
    # every element of every gradient once a step and replica, in fp32 (the 0-d one too)
    total = REPLICAS * STEPS * 4 * sum(v.numel() for v in _tensors().values())
    assert sum(extents) == (0 if shm else total), extents
    first = _tensors()
    for step, (a, b) in enumerate(zip(whole, sliced)):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
            assert not torch.equal(a[name], first[name]), (step, name)  # it moved


@pytest.fixture
def job(cluster2: shardps.LocalCluster):
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=64)
    client.register(_tensors(), ADAM)
    yield client
    client.close()


def _raw_push(client: shardps.PSClient, shard: int, sl: ps_pb2.TensorSlice, values: torch.Tensor,
              shape: tuple[int, ...], offset: int = 0) -> grpc.RpcError:
    req = ps_pb2.PushRequest(worker_id=0, step=0, base_version=0, epoch=client.epoch, last=True, slices=[sl],
                             chunk=ps_pb2.Chunk(name=sl.name, offset=offset, dtype=codec.to_wire_dtype(torch.float32),
                                                data=values.numpy().tobytes(), shape=shape))
    with pytest.raises(grpc.RpcError) as info, FrameStub(client.transport.addresses[shard]) as stub:
        stub.Push([req], timeout=10)
    return info.value


BAD = [
    (ps_pb2.TensorSlice(name="w", dim=2, parts=2, index=0), (5, 6), "dim must be in [0, 2) for shape [10, 6], got 2"),
    (ps_pb2.TensorSlice(name="w", dim=0, parts=2, index=2), (5, 6), "index must be in [0, 2) for parts 2, got 2"),
    (ps_pb2.TensorSlice(name="w", dim=0, parts=0, index=0), (5, 6), "parts must be >= 1, got 0"),
    (ps_pb2.TensorSlice(name="w", dim=1, parts=2, index=0, blocks=4), (10, 3),
     "blocks must be >= 1 and divide dimension 1 (size 6) into equal blocks, got 4"),
    (ps_pb2.TensorSlice(name="w", dim=1, parts=2, index=0), (10, 6), "shape expected (10, 3), got (10, 6)"),
    (ps_pb2.TensorSlice(name="s", dim=0, parts=1, index=0), (), "a tensor of shape [] has no dimension to slice"),
]


@pytest.mark.parametrize(("bad", "shape", "says"), BAD)
def test_bad_sliced_pushes_are_invalid_argument_and_change_nothing(job, bad, shape, says) -> None:
    shard = next(p.server for p in job.shard_map.parts_of(bad.name))
    before = job.stats()[shard]
    err = _raw_push(job, shard, bad, torch.ones(3), shape)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert f"tensor {bad.name!r}" in err.details() and says in err.details(), err.details()
    after = job.stats()[shard]
    assert (after["version"], after["worker_clocks"], after["push_bytes_total"]) == (
        before["version"], before["worker_clocks"], before["push_bytes_total"])
    assert torch.equal(job.pull(["w"])["w"], _tensors()["w"])


def test_a_chunk_outside_its_slice_is_refused(job) -> None:
    sl = ps_pb2.TensorSlice(name="v", dim=0, parts=2, index=1)  # elements 4..6 of 7: the slice's [0, 3)
    shard = next(p.server for p in job.shard_map.parts_of("v"))
    err = _raw_push(job, shard, sl, torch.ones(4), (3,))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 'v': chunk [0, 4) is out of range" in err.details() and "of 3 elements" in err.details()


def test_slices_need_a_barrier(cluster2: shardps.LocalCluster) -> None:
    with shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=64) as client:
        client.register(_tensors(), ADAM, sync="asp")
        sl = TensorSlice(0, 2, 0)
        with pytest.raises(shardps.ShardError) as info:
            push_slices(client, {"v": torch.ones(4)}, {"v": sl}, 0, client.versions)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "needs a barrier sync mode" in info.value.details
        assert all(s["version"] == 0 for s in client.stats())


def test_the_backup_replays_sliced_pushes_to_the_same_state(make_cluster) -> None:
    c = make_cluster(2, replicas=2)
    backup_of = {b.shard_index: b for b in c.backups}
    trained = _train(c.addresses, sliced=True)
    for st in c.stores:
        same_state(st, backup_of[st.shard_index])
        assert st.stats().replication_lag_ops == 0
    assert torch.equal(trained[-1]["w"], _train(make_cluster(2).addresses, sliced=False)[-1]["w"])


def test_every_message_of_a_push_names_the_same_slices(job) -> None:
    shard = next(p.server for p in job.shard_map.parts_of("v"))
    head = dict(worker_id=0, step=0, base_version=0, epoch=job.epoch)
    sl = ps_pb2.TensorSlice(name="v", dim=0, parts=2, index=0)
    chunk = ps_pb2.Chunk(name="v", offset=0, dtype=codec.to_wire_dtype(torch.float32),
                         data=torch.ones(4).numpy().tobytes(), shape=[4])
    msgs = [ps_pb2.PushRequest(**head, slices=[sl], chunk=chunk),
            ps_pb2.PushRequest(**head, slices=[ps_pb2.TensorSlice(name="v", dim=0, parts=2, index=1)], last=True)]
    with pytest.raises(grpc.RpcError) as info, FrameStub(job.transport.addresses[shard]) as stub:
        stub.Push(msgs, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Push stream mixes headers: message 2 has slices" in info.value.details(), info.value.details()
    assert job.stats()[shard]["version"] == 0
