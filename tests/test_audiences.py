"""Services per audience, a token per audience: real servers on loopback ports.

A server given a worker, an operator and a peer token admits each to its own
service only (Workers, Operator, Peers): a known token on another audience's
service is PERMISSION_DENIED and changes nothing; an unknown or missing one
is UNAUTHENTICATED; the shared token works everywhere.
"""

from __future__ import annotations

import io

import grpc
import pytest
import torch

import shardps
from shardps.admin import run_set_sync
from shardps.protos import env
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.auth import audience_of

ROLES = Security(worker_token="w0rker", operator_token="0perator", peer_token="p33r")


def _train(addresses, security, steps=2, **kw):
    with shardps.connect(addresses, security=security, ready_timeout=10, recovery_timeout=10, **kw) as client:
        client.register({"w": torch.arange(6.0), "v": torch.zeros(3)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        for step in range(steps):
            client.push({"w": torch.ones(6), "v": torch.ones(3)}, step=step)
            out = client.pull(min_versions=step + 1)
        return out, client.stats()


def _channel(address: str, token: str | None) -> grpc.Channel:
    return Security(token=token).channel(address)


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_the_services_have_one_audience_each():
    assert audience_of("/shardps.v1.Workers/Heartbeat") == "worker"
    assert audience_of("/shardps.v1.Operator/Rollback") == "operator"
    assert audience_of("/shardps.v1.Peers/Replicate") == "peer"
    assert audience_of("/shardps.v1.Rows/PushRows") == "worker"  # row tables: the workers' too
    assert audience_of("/shardps.v1.Experts/Backward") == "worker"  # experts run where they live (MoE "send")
    assert audience_of("/grpc.health.v1.Health/Check") is None
    services = {s.name: [m.name for m in s.methods] for s in ps_pb2.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "Workers": ["Register", "Heartbeat", "Leave", "Describe", "Recover", "TakeOver", "Connect"],
        "Operator": ["Stats", "SetSync", "Checkpoint", "Rollback", "Promote", "AttachReplica", "PullState"],
        "Peers": ["Exchange", "Replicate", "Describe"],
        "Rows": ["RegisterRows", "PullRows", "PushRows"],
    }


def test_a_client_sends_its_roles_token_or_the_shared_one():
    assert ROLES.token_for("worker") == "w0rker" and ROLES.token_for("peer") == "p33r"
    assert ROLES.token_for(None) is None
    shared = Security(token="s", operator_token="o")
    assert (shared.token_for("worker"), shared.token_for("operator"), shared.token_for(None)) == ("s", "o", "s")
    with pytest.raises(ValueError, match="no audience 'admin'"):
        ROLES.token_for("admin")
    with pytest.raises(ValueError, match="the peer token must be non-empty"):
        Security(peer_token="a b")


def test_role_tokens_come_from_the_environment(monkeypatch, tmp_path):
    for name in env.ALL:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "op").write_text("from-file\n")
    monkeypatch.setenv(env.WORKER_TOKEN, "from-env")
    monkeypatch.setenv(env.OPERATOR_TOKEN_FILE, str(tmp_path / "op"))
    monkeypatch.setenv(env.PEER_TOKEN, "ignored")
    sec = Security.from_env(peer_token_file=str(tmp_path / "op"))
    assert (sec.token, sec.worker_token, sec.operator_token, sec.peer_token) == (None, "from-env", "from-file",
                                                                                 "from-file")
    assert sec.any_token and "worker/operator/peer tokens" in sec.describe()


@pytest.mark.cluster
def test_a_worker_token_trains_but_cannot_operate_or_replicate(make_cluster):
    cluster = make_cluster(2, security=ROLES)
    worker = Security(worker_token="w0rker")
    out, _ = _train(cluster.addresses, worker)
    assert torch.equal(out["w"], torch.arange(6.0) - 2)
    store = cluster.stores[0]
    before = (store.job.version, store.job.epoch, str(store.job.sync), store.state_hash(), store.replica.role)
    ch = _channel(cluster.addresses[0], "w0rker")
    try:
        op, peers = ps_pb2_grpc.OperatorStub(ch), ps_pb2_grpc.PeersStub(ch)
        calls = {
            "/shardps.v1.Operator/Rollback": lambda: op.Rollback(ps_pb2.RollbackRequest(version=0, epoch=7),
                                                                 timeout=10),
            "/shardps.v1.Operator/Promote": lambda: op.Promote(ps_pb2.PromoteRequest(force=True), timeout=10),
            "/shardps.v1.Operator/SetSync": lambda: op.SetSync(ps_pb2.SetSyncRequest(sync="asp"), timeout=10),
            "/shardps.v1.Operator/Stats": lambda: op.Stats(ps_pb2.StatsRequest(), timeout=10),
            "/shardps.v1.Peers/Replicate": lambda: peers.Replicate(iter([ps_pb2.ReplicateRequest(
                seq=1, op="snapshot", shard_index=0, num_shards=2)]), timeout=10),
        }
        for method, call in calls.items():
            code, details = _code(call)
            audience = "peer" if "Peers" in method else "operator"
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
            assert details.startswith(f"{method} is for the {audience} audience: this token is the worker token")
    finally:
        ch.close()
    assert (store.job.version, store.job.epoch, str(store.job.sync), store.state_hash(), store.replica.role) == before
    # The operator's command sent with the worker's token is refused too, naming the audience.
    with pytest.raises(shardps.ShardError) as err:
        run_set_sync(cluster.addresses, "asp", security=Security(operator_token="w0rker"), out=io.StringIO())
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "operator" in err.value.details
    assert str(store.job.sync) == "bsp"


@pytest.mark.cluster
def test_the_operator_token_operates_and_is_refused_on_the_data_path(make_cluster, tmp_path):
    cluster = make_cluster(2, security=ROLES, checkpoint_dir=str(tmp_path))
    both = Security(worker_token="w0rker", operator_token="0perator")
    _train(cluster.addresses, both)
    operator = Security(operator_token="0perator")
    out = io.StringIO()
    assert run_set_sync(cluster.addresses, "asp", security=operator, out=out) == 0
    assert all(str(st.job.sync) == "asp" for st in cluster.stores)
    ch = _channel(cluster.addresses[0], "0perator")
    try:
        op = ps_pb2_grpc.OperatorStub(ch)
        version = op.Checkpoint(ps_pb2.CheckpointRequest(), timeout=10).version
        r = op.Rollback(ps_pb2.RollbackRequest(version=version, epoch=1), timeout=10)
        assert (r.version, r.epoch) == (version, 1) and cluster.stores[0].job.epoch == 1
        assert op.Promote(ps_pb2.PromoteRequest(force=True), timeout=10).epoch == 1  # a primary already: no-op
        workers = ps_pb2_grpc.WorkersStub(ch)
        code, details = _code(lambda: workers.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=0), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "for the worker audience" in details
        code, _ = _code(lambda: ps_pb2_grpc.PeersStub(ch).Describe(ps_pb2.StatsRequest(), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        ch.close()
    # A client holding both tokens sends each where it belongs (set_sync over its transport).
    with shardps.connect(cluster.addresses, security=both, ready_timeout=10) as client:
        assert client.set_sync("bsp") == ["bsp", "bsp"]


@pytest.mark.cluster
def test_unknown_or_missing_tokens_are_unauthenticated_and_the_shared_token_works_everywhere(make_cluster):
    cluster = make_cluster(1, security=Security(token="sh4red", worker_token="w0rker", operator_token="0perator",
                                                peer_token="p33r"))
    for token in (None, "nope"):
        ch = _channel(cluster.addresses[0], token)
        try:
            for stub, method in ((ps_pb2_grpc.WorkersStub(ch), "Describe"), (ps_pb2_grpc.OperatorStub(ch), "Stats")):
                call = getattr(stub, method)
                assert _code(lambda call=call: call(ps_pb2.StatsRequest(), timeout=10))[0] == \
                    grpc.StatusCode.UNAUTHENTICATED
        finally:
            ch.close()
    shared = Security(token="sh4red")
    _train(cluster.addresses, shared)
    ch = _channel(cluster.addresses[0], "sh4red")
    try:
        assert ps_pb2_grpc.OperatorStub(ch).SetSync(ps_pb2.SetSyncRequest(sync="asp"), timeout=10).sync == "asp"
        assert ps_pb2_grpc.PeersStub(ch).Describe(ps_pb2.StatsRequest(), timeout=10).sync == "asp"
        assert ps_pb2_grpc.WorkersStub(ch).Describe(ps_pb2.StatsRequest(), timeout=10).sync == "asp"
    finally:
        ch.close()


@pytest.mark.fault
def test_replication_and_fail_over_with_the_peer_and_worker_tokens(make_cluster):
    cluster = make_cluster(2, security=ROLES, replicas=2)
    backup_of = {b.shard_index: b for b in cluster.backups}
    worker = Security(worker_token="w0rker")
    with shardps.connect(cluster.addresses, security=worker, ready_timeout=10, recovery_timeout=10) as client:
        client.register({"w": torch.arange(6.0), "v": torch.zeros(3)}, shardps.optim.SGD(lr=1.0), sync="asp")
        client.push({"w": torch.ones(6), "v": torch.ones(3)}, step=0)
        for st in cluster.stores:  # Replicate went through with the peer token
            assert st.stats().replica_state == "synced"
            assert st.state_hash() == backup_of[st.shard_index].state_hash()
        ch = _channel(client.backups[0], "w0rker")
        try:
            # A worker cannot force a promotion, and its TakeOver is refused while the primary serves
            # (the backup asked the primary's Describe with the peer token).
            code, _ = _code(lambda: ps_pb2_grpc.OperatorStub(ch).Promote(ps_pb2.PromoteRequest(force=True),
                                                                          timeout=10))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            code, details = _code(lambda: ps_pb2_grpc.WorkersStub(ch).TakeOver(ps_pb2.TakeOverRequest(),
                                                                                timeout=10))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "still answers SERVING" in details
            assert backup_of[0].replica.role == "backup"
        finally:
            ch.close()
        cluster.stop_server(1)  # shard 0's primary goes away: the worker's TakeOver succeeds
        client.push({"w": torch.ones(6), "v": torch.ones(3)}, step=1)
        assert torch.equal(client.pull()["w"], torch.arange(6.0) - 2)
        assert client.failovers_total == 1 and backup_of[0].replica.role == "primary"
