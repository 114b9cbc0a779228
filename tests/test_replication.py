"""--replicas 2: every shard has a backup on the next server; kill -9 a primary, the backup takes over,
and nothing a worker was told is taken in is lost."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from prometheus_client import generate_latest

import shardps
from shardps.admin import run_attach_replica, run_promote
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.service import create_server, stop_server
from shardps.server.store import ShardStore
from shardps.testing.frames import FrameStub
from tests.replicas import model, same_state, train


def test_the_backup_replays_every_change_to_thesame_state(make_cluster):
    """bsp, a live switch to asp and to every:2, loss scaling with a skipped step: backup == primary, bit for bit."""
    c = make_cluster(2, replicas=2)
    assert [s.stats().replica_state for s in c.stores] == ["synced", "synced"]
    backup_of = {b.shard_index: b for b in c.backups}
    switched = threading.Event()

    def on_step(k, step, client):
        if k == 0 and step == 4:
            client.set_sync("asp")
        if k == 0 and step == 9:
            client.set_sync("every:2")
            switched.set()

    train(c.addresses, model(), 14, on_step=on_step, grad_dtype=torch.float16,
           loss_scaling=shardps.LossScaling(init_scale=2.0 ** 24))
    assert switched.is_set()
    for st in c.stores:
        same_state(st, backup_of[st.shard_index])
        assert st.stats().sync_switches_total == 2 and st.stats().replication_lag_ops == 0


def test_a_switch_made_from_a_push_and_a_late_gradient_are_replayed_by_the_backup(make_cluster):
    """One worker, SGD(lr=1). set-sync bsp reaches shard 0 only. Step 1 was computed under asp: shard 0 takes it
    as late (summed into its first bsp round, not waited for), shard 1 applies it. Step 2 says (bsp, switch 1):
    shard 1 makes the switch itself. Each backup replays both to the primary's state, bit for bit."""
    c = make_cluster(2, replicas=2)
    backup_of = {b.shard_index: b for b in c.backups}
    grads = [{"w": torch.full((4,), float(v)), "b": torch.full((3,), float(v))} for v in (1, 2, 4)]
    with shardps.connect(c.addresses, part_bytes=16) as client:
        client.register({"w": torch.zeros(4), "b": torch.zeros(3)}, shardps.optim.SGD(lr=1.0), sync="asp")
        client.push(grads[0], 0)
        with shardps.connect(c.addresses[:1]) as ctl:
            assert ctl.set_sync("bsp") == ["bsp"]
        r1 = client.push(grads[1], 1)
        assert [(r.sync, r.sync_switch, r.ready_version) for r in r1] == [("bsp", 1, 1), ("asp", 0, 2)]
        assert client.sync_said == ("bsp", 1)
        r2 = client.push(grads[2], 2)
        assert [(r.sync, r.sync_switch, r.version) for r in r2] == [("bsp", 1, 2), ("bsp", 1, 3)]
        got = client.pull()
    placed = {name: i for i, st in enumerate(c.stores) for name in st.names()}
    for name, t in got.items():  # shard 0: -1, then the mean of 2 and 4; shard 1: -1 - 2 - 4
        assert torch.equal(t, torch.full_like(t, -4.0 if placed[name] == 0 else -7.0)), (name, placed)
    assert sorted(placed.values()) == [0, 1]  # one tensor on each shard
    for st in c.stores:
        same_state(st, backup_of[st.shard_index])
        assert st.stats().sync == "bsp" and st.stats().sync_switches_total == 1
        assert st.stats().gradients_applied_total == 3


def test_an_acknowledged_push_is_already_on_the_backup(make_cluster):
    c = make_cluster(2, replicas=2)
    backup_of = {b.shard_index: b for b in c.backups}
    with shardps.connect(c.addresses, part_bytes=512) as client:
        client.register({"w": torch.zeros(300), "b": torch.zeros(7)}, shardps.optim.SGD(lr=0.5), sync="asp")
        assert client.backups == [c.replica_addresses[1], c.replica_addresses[0]]
        for step in range(5):
            results = client.push({"w": torch.ones(300), "b": torch.ones(7)}, step)
            for shard, r in enumerate(results):
                # Acknowledged: the backup has taken it in, in the same version.
                assert backup_of[shard].job.worker_clocks[0] == step
                assert backup_of[shard].job.version == r.version
            got = client.pull()
            assert torch.equal(got["w"], torch.full((300,), -0.5 * (step + 1)))


def test_a_push_the_barrier_refuses_is_not_sent_to_the_backup(make_cluster, caplog):
    """bsp, 2 workers: worker 0 pushes step 1 while its step 0 still waits for the round. The primary refuses it
    (FAILED_PRECONDITION, nothing changed) and records nothing: the backup, which used to be sent the push and
    failed to replay it the same way, asking for the whole state again, stays in step without a resync."""
    c = make_cluster(2, replicas=2)
    backup_of = {b.shard_index: b for b in c.backups}
    ones = {"w": torch.ones(300), "b": torch.ones(7)}
    with shardps.connect(c.addresses, worker_id=0, num_workers=2, part_bytes=512) as c0, \
            shardps.connect(c.addresses, worker_id=1, num_workers=2, part_bytes=512) as c1:
        c0.register({"w": torch.zeros(300), "b": torch.zeros(7)}, shardps.optim.SGD(lr=0.5), sync="bsp")
        c1.register({"w": torch.zeros(300), "b": torch.zeros(7)}, shardps.optim.SGD(lr=0.5), sync="bsp")
        c0.push(ones, 0)  # held: worker 1 has not pushed
        recorded = [st.replica.replicator.seq for st in c.stores]
        with pytest.raises(shardps.ShardError) as e:
            c0.push(ones, 1)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "still waits for the barrier" in e.value.details
        assert [st.replica.replicator.seq for st in c.stores] == recorded
        c1.push(ones, 0)  # the round completes on the primary and, replayed, on the backup
        for st in c.stores:
            st.replica.replicated()
            assert st.stats().replica_state == "synced" and st.job.version == 1
            same_state(st, backup_of[st.shard_index])
    assert "asks for a resync" not in caplog.text


def test_dc_asgd_and_evictions_are_replicated(make_cluster):
    c = make_cluster(2, replicas=2, lease_s=60.0)
    backup_of = {b.shard_index: b for b in c.backups}
    with shardps.connect(c.addresses, worker_id=0, num_workers=2, part_bytes=256) as c0, \
            shardps.connect(c.addresses, worker_id=1, num_workers=2, part_bytes=256) as c1:
        params = {"w": torch.linspace(-1, 1, 128)}
        c0.register(params, shardps.optim.SGD(lr=0.1), sync="asp", staleness_remedy="dc-asgd:0.5")
        c1.register(params, shardps.optim.SGD(lr=0.1), sync="asp", staleness_remedy="dc-asgd:0.5")
        for step in range(4):
            for cl in (c0, c1):
                cl.pull()  # dc-asgd keeps what each worker pulled: the backup must too
                cl.push({"w": torch.randn(128, generator=torch.Generator().manual_seed(step))}, step)
        c1.stop_heartbeats()
        for st in c.stores:  # worker 1 falls silent
            st.leases.stop_reaper()  # evicted by this check, not by the reaper between these two lines
            st.leases.membership.last_seen[1] = time.monotonic() - 120
            assert st.leases.evict_expired() == [1]
            st.replica.replicated()
        c0.push({"w": torch.ones(128)}, 4)
    for st in c.stores:
        same_state(st, backup_of[st.shard_index])
        assert backup_of[st.shard_index].applier.stale_weights.keys() == st.applier.stale_weights.keys()
        assert backup_of[st.shard_index].stats().evicted_workers == [1]


def test_promotion_is_refused_while_the_primary_serves(make_cluster):
    c = make_cluster(2, replicas=2)
    with shardps.connect(c.addresses) as client:
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=0.1), sync="bsp")
    backup = c.replica_addresses[1]  # server 1 holds shard 0's backup
    out = io.StringIO()
    with pytest.raises(shardps.ShardError) as e:
        run_promote([backup], out=out)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"the primary of shard 0 at {c.addresses[0]} still answers SERVING" in e.value.details
    # A backup does not serve the data path before it is promoted (no data connection is given: Connect is
    # refused); the error names the primary.
    with pytest.raises(grpc.RpcError) as rpc, FrameStub(backup) as stub:
        stub.Pull(ps_pb2.PullRequest(worker_id=0), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"this is a backup of shard 0 (its primary: {c.addresses[0]})" in rpc.value.details()
    # An endpoint that never received a copy has nothing to take over with.
    empty = ShardStore(0, 2, role="backup")
    server, port = create_server(empty)
    try:
        with pytest.raises(shardps.ShardError, match="holds no copy of shard 0 yet"):
            run_promote([f"127.0.0.1:{port}"], force=True, out=out)
    finally:
        stop_server(server)


@pytest.mark.cluster
def test_replicate_refuses_gaps_and_other_shards():
    backup = ShardStore(1, 2, role="backup")
    server, port = create_server(backup)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = ps_pb2_grpc.PeersStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as e:  # an op before the whole state: ABORTED, send a snapshot
            stub.Replicate(iter([ps_pb2.ReplicateRequest(seq=5, op="register_worker", args_json='{"worker": 0}',
                                                         shard_index=1, num_shards=2)]), timeout=10)
        assert e.value.code() == grpc.StatusCode.ABORTED and "never got the whole state" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Replicate(iter([ps_pb2.ReplicateRequest(seq=1, op="snapshot", shard_index=0, num_shards=2)]),
                           timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "backs shard 1 of 2, got changes of shard 0 of 2" in e.value.details()
        assert backup.job.version == 0 and not backup.replica.replica_synced
    finally:
        channel.close()
        stop_server(server)


@pytest.mark.fault
def test_a_wrongly_deposed_primary_stops_and_the_workers_follow_its_backup(make_cluster):
    """ctl promote --force while shard 0's primary is alive: it is fenced off (its next change is refused
    by the promoted backup), the workers move over, and the result equals a run without any of it."""
    base = model()
    clean = train(make_cluster(2).addresses, base, 12)
    c = make_cluster(2, replicas=2)

    def on_step(k, step, client):
        if k == 0 and step == 5:
            assert run_promote([c.replica_addresses[1]], force=True, out=io.StringIO()) == 0

    got = train(c.addresses, base, 12, on_step=on_step)
    for (exp, _), (res, failovers) in zip(clean, got):
        assert failovers == 1
        for n in exp:
            assert torch.equal(res[n], exp[n]), n
    assert c.stores[0].stats().role == "deposed"
    assert c.backups[1].stats().role == "primary" and c.backups[1].job.version == 12


@pytest.mark.fault
def test_losing_the_backup_degrades_and_attach_replica_resyncs(make_cluster, caplog):
    caplog.set_level(logging.WARNING, logger="shardps.server")
    c = make_cluster(2, replicas=2)
    base = model()
    c.stop_server(2)  # server 1's backup endpoint (shard 0's backup) goes away
    train(c.addresses, base, 4)
    assert c.stores[0].stats().replica_state == "degraded"
    assert "going on without a copy" in caplog.text
    fresh = ShardStore(0, 2, role="backup")
    server, port = create_server(fresh)
    try:
        assert run_attach_replica(c.addresses, 0, f"127.0.0.1:{port}", out=io.StringIO()) == 0
        same_state(c.stores[0], fresh)
        train(c.addresses, base, 3)  # a new job step count is fine: the workers' clocks go on
        same_state(c.stores[0], fresh)
    finally:
        stop_server(server)


def test_split_tensors_are_refused_with_a_backup(make_cluster):
    c = make_cluster(2, replicas=2)
    with shardps.connect(c.addresses) as client:
        with pytest.raises(shardps.ShardError) as e:
            client.register({"m": torch.zeros(64, 64)}, shardps.optim.Adafactor(), sync="bsp", max_whole_bytes=1024)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "shards with a backup (--replicas 2) keep such tensors whole" in e.value.details


def test_metrics_follow_the_shard_to_its_backup(make_cluster):
    c = make_cluster(2, replicas=2, metrics=True)
    train(c.addresses, model(), 3)
    text = generate_latest(c.registries[0]).decode()
    assert 'shardps_replica_state{shard="0",state="synced"} 1.0' in text
    assert 'shardps_replication_lag_ops{shard="0"} 0.0' in text
    assert 'shardps_backup_replayed_ops{shard="1"}' in text
    assert "shardps_replication_wait_seconds_count" in text
    run_promote([c.replica_addresses[0]], force=True, out=io.StringIO())  # server 0 now serves shard 1 too
    text = generate_latest(c.registries[0]).decode()
    assert 'shardps_shard_version{shard="1"} 3.0' in text and 'shardps_shard_version{shard="0"} 3.0' in text
    assert 'shardps_promotions_total{shard="1"} 1.0' in text


def test_a_wildcard_bind_advertises_the_machine_name():
    import socket

    from shardps.server.app import advertised

    assert advertised("0.0.0.0", 7000) == f"{socket.gethostname()}:7000"
    assert advertised("10.0.0.5", 7000) == "10.0.0.5:7000"


@pytest.mark.cluster
def test_cli_refuses_replication_it_cannot_do():
    p = subprocess.run([sys.executable, "-m", "shardps", "server", "--replicas", "2", "--num-shards", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "needs at least 2 servers" in p.stderr
    p = subprocess.run([sys.executable, "-m", "shardps", "server", "--replica-target", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--replica-target needs --replicas 2" in p.stderr
