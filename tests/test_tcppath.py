"""The TCP bulk path (worker/tcppath.py, server/tcpdata.py): tensor bytes on a TCP connection beside gRPC.

Exact against gRPC (the same bytes, another road), a bad frame refused with
a status naming the tensor and the bytes expected and received (nothing
changes), the path dropped for gRPC when its connection ends, and no
thread left once the client and the servers closed. In-process servers on
loopback ports; ``shm=False`` so that the same-host path does not come first.
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch

import shardps
from shardps.protos import env, tcpdata
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.worker import tcppath
from shardps.worker.paths import GrpcPath
from shardps.worker.tcppath import TcpPath
from tests.helpers import train_over_paths


@pytest.mark.parametrize("opt_kw", [dict(sync="bsp"), dict(sync="bsp", overlap=True, bucket_bytes=3000),
                                    dict(sync="every:2", grad_dtype=torch.bfloat16, pull_dtype=torch.bfloat16)],
                         ids=["bsp", "bsp-overlap", "every2-bf16"])
def test_tcp_gives_the_weights_grpc_gives(make_cluster, monkeypatch, opt_kw):
    monkeypatch.setenv(env.TCP, "0")  # the workers decline the data port the shards offer
    over_grpc = train_over_paths(make_cluster(2).addresses, shm=False, **opt_kw)
    monkeypatch.delenv(env.TCP)
    over_tcp = train_over_paths(make_cluster(2).addresses, shm=False, **opt_kw)
    for k in range(2):
        assert over_grpc[k][0] == ["GrpcPath"] * 2 and over_tcp[k][0] == ["TcpPath"] * 2
        for n, w in over_grpc[k][1].items():
            assert torch.equal(over_tcp[k][1][n], w), f"worker {k}, {n}"


def test_a_server_with_tcp_off_offers_no_data_port(make_cluster, monkeypatch):
    monkeypatch.setenv(env.TCP, "0")
    cluster = make_cluster(1)
    monkeypatch.delenv(env.TCP)  # the worker would take one
    with shardps.connect(cluster.addresses, shm=False) as client:
        client.register({"w": torch.zeros(3)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert [type(p) for p in client.paths] == [GrpcPath]


def test_tls_or_a_token_keeps_the_bytes_in_grpc(monkeypatch):
    monkeypatch.delenv(env.TCP, raising=False)
    assert tcppath.wanted(Security())
    assert not tcppath.wanted(Security(token="secret"))
    monkeypatch.setenv(env.TCP, "0")
    assert not tcppath.wanted(Security())


@pytest.fixture
def one_shard(make_cluster):
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, shm=False, timeout=2.0)  # the frame deadline: 2 s
    client.register({"w": torch.randn(4, 5)}, shardps.optim.SGD(lr=0.5), sync="bsp")
    assert isinstance(client.paths[0], TcpPath)
    channel = grpc.insecure_channel(cluster.addresses[0])
    yield cluster.stores[0], ps_pb2_grpc.WorkersStub(channel), client
    channel.close()
    client.close()


def _push(stub, seq, nbytes=80):
    reqs = [ps_pb2.PushRequest(worker_id=0, step=0, shm=tcpdata.segment_name(seq), last=True, chunk=ps_pb2.Chunk(
        name="w", offset=0, dtype=ps_pb2.FLOAT32, shape=[4, 5], shm_offset=0, shm_bytes=nbytes))]
    return stub.Push(iter(reqs), timeout=10)


def _frame(link, seq, nbytes, sent=None):
    """A frame that announces ``nbytes`` and carries ``sent`` of them (all by default)."""
    link.sock.sendall(tcpdata.FRAME.pack(tcpdata.FRAME_MAGIC, seq, 0, nbytes))
    link.sock.sendall(bytes(nbytes if sent is None else sent))


def _refused(stub, seq, *fragments):
    with pytest.raises(grpc.RpcError) as err:
        _push(stub, seq)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())


def test_a_frame_of_the_wrong_size_or_none_is_refused_and_changes_nothing(one_shard):
    store, stub, client = one_shard
    link = client.paths[0].link
    before = store.state_hash()
    _frame(link, 100, 40)
    _refused(stub, 100, "'w'", "expected 80 bytes, received 40")
    _refused(stub, 101, "'w'", "expected 80 bytes, received none within 2.0s")  # no frame at all
    _frame(link, 103, 80)
    _refused(stub, 102, "'w'", "received none before frames of a later one (103)")
    assert store.state_hash() == before and store.pushes_total == 0
    _push(stub, 103)  # that frame is whole and of the size the message says: taken
    assert store.pushes_total == 1


def test_a_torn_frame_is_refused_changes_nothing_and_the_worker_goes_to_grpc(one_shard):
    store, stub, client = one_shard
    path = client.paths[0]
    before = store.state_hash()
    _frame(path.link, 100, 80, sent=30)
    path.link.sock.shutdown(socket.SHUT_WR)  # the worker's end stops mid-frame
    _refused(stub, 100, "'w'", "expected 80 bytes, received 30 of 80", "connection closed")
    assert store.state_hash() == before and store.pushes_total == 0
    assert path.link.receiver.join(10)  # the shard closed it: the path went off
    assert isinstance(client.paths[0], GrpcPath)
    w = store.weights("w")[0]
    client.push({"w": torch.ones(4, 5)}, step=0)
    assert torch.equal(client.pull(min_versions=1)["w"], w - 0.5)


def test_a_lost_data_connection_sends_the_next_calls_over_grpc_with_the_same_result(make_cluster):
    w, grad = torch.randn(600), torch.randn(600)
    got = []
    for lose in (False, True):
        cluster = make_cluster(2)
        with shardps.connect(cluster.addresses, part_bytes=1024, shm=False) as client:
            client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
            client.push({"w": grad}, step=0)
            path = client.paths[1]
            if lose:
                path.link.sock.shutdown(socket.SHUT_RD)  # the connection ends under the reader (the shard stays)
                assert path.link.receiver.join(10)
                assert [type(p) for p in client.paths] == [TcpPath, GrpcPath]
            client.push({"w": grad}, step=1)
            got.append(client.pull(min_versions=2)["w"])
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0], w - grad - grad)


def test_no_thread_is_left_behind(make_cluster):
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses, shm=False) as client:
        client.register({"w": torch.zeros(600)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        client.push({"w": torch.ones(600)}, step=0)
        assert any(t.name.startswith("shardps-tcp-") for t in threading.enumerate())
    cluster.stop()
    assert [t.name for t in threading.enumerate() if t.name.startswith("shardps-tcp-")] == []
