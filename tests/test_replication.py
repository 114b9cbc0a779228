"""--replicas 2: every shard has a backup on the next server; kill -9 a primary, the backup takes over,
and nothing a worker was told is taken in is lost."""

from __future__ import annotations

import copy
import io
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from prometheus_client import generate_latest
from torch import nn

import shardps
from shardps.admin import run_attach_replica, run_promote
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.service import create_server, stop_server
from shardps.server.store import ShardStore
from tests.helpers import run_workers

W = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def _big_model() -> nn.Module:
    """One weight of 2 MiB: its gradient travels to the backup in several Replicate messages."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 4))


def _train(addresses, base, steps, *, sync="bsp", on_step=None, part_bytes=512, timeout=240, backups=None,
           **opt_kw):
    """W workers in threads; each returns (its final parameters, its client's failovers)."""

    def worker(k):
        model = copy.deepcopy(base)
        with shardps.connect(addresses, worker_id=k, num_workers=W, part_bytes=part_bytes,
                             recovery_timeout=60, backups=backups) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync,
                                               **opt_kw)
            for step in range(steps):
                g = torch.Generator().manual_seed(step * 10 + k)
                model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if on_step is not None:
                    on_step(k, step, client)
            return {n: p.detach().clone() for n, p in model.named_parameters()}, client.failovers_total
    return run_workers(worker, W, timeout=timeout)


def _same_state(primary: ShardStore, backup: ShardStore) -> None:
    assert primary.state_hash() == backup.state_hash()
    p, b = primary.stats(), backup.stats()
    for key in ("version", "worker_clocks", "loss_scale", "sync", "evicted_workers", "gradients_applied_total",
                "skipped_steps_total", "staleness_counts", "epoch"):
        assert getattr(p, key) == getattr(b, key), key


def test_the_backup_replays_every_change_to_the_same_state(make_cluster):
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

    _train(c.addresses, _model(), 14, on_step=on_step, grad_dtype=torch.float16,
           loss_scaling=shardps.LossScaling(init_scale=2.0 ** 24))
    assert switched.is_set()
    for st in c.stores:
        _same_state(st, backup_of[st.shard_index])
        assert st.stats().sync_switches_total == 2 and st.stats().replication_lag_ops == 0


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
                assert backup_of[shard].worker_clocks[0] == step
                assert backup_of[shard].version == r.version
            got = client.pull()
            assert torch.equal(got["w"], torch.full((300,), -0.5 * (step + 1)))


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
            st.membership.last_seen[1] = time.monotonic() - 120
            assert st.evict_expired() == [1]
            st.replicated()
        c0.push({"w": torch.ones(128)}, 4)
    for st in c.stores:
        _same_state(st, backup_of[st.shard_index])
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
    # A backup does not serve the data path before it is promoted; the error names the primary.
    channel = grpc.insecure_channel(backup)
    stub = ps_pb2_grpc.WorkersStub(channel)
    with pytest.raises(grpc.RpcError) as rpc:
        list(stub.Pull(ps_pb2.PullRequest(worker_id=0), timeout=10))
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
        channel.close()


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
        assert backup.version == 0 and not backup.replica_synced
    finally:
        channel.close()
        stop_server(server)


@pytest.mark.fault
def test_a_wrongly_deposed_primary_stops_and_the_workers_follow_its_backup(make_cluster):
    """ctl promote --force while shard 0's primary is alive: it is fenced off (its next change is refused
    by the promoted backup), the workers move over, and the result equals a run without any of it."""
    base = _model()
    clean = _train(make_cluster(2).addresses, base, 12)
    c = make_cluster(2, replicas=2)

    def on_step(k, step, client):
        if k == 0 and step == 5:
            assert run_promote([c.replica_addresses[1]], force=True, out=io.StringIO()) == 0

    got = _train(c.addresses, base, 12, on_step=on_step)
    for (exp, _), (res, failovers) in zip(clean, got):
        assert failovers == 1
        for n in exp:
            assert torch.equal(res[n], exp[n]), n
    assert c.stores[0].stats().role == "deposed"
    assert c.backups[1].stats().role == "primary" and c.backups[1].version == 12


@pytest.mark.fault
def test_losing_the_backup_degrades_and_attach_replica_resyncs(make_cluster, caplog):
    caplog.set_level(logging.WARNING, logger="shardps.server")
    c = make_cluster(2, replicas=2)
    base = _model()
    c._servers[2].stop(None)  # server 1's backup endpoint (shard 0's backup) goes away
    _train(c.addresses, base, 4)
    assert c.stores[0].stats().replica_state == "degraded"
    assert "going on without a copy" in caplog.text
    fresh = ShardStore(0, 2, role="backup")
    server, port = create_server(fresh)
    try:
        assert run_attach_replica(c.addresses, 0, f"127.0.0.1:{port}", out=io.StringIO()) == 0
        _same_state(c.stores[0], fresh)
        _train(c.addresses, base, 3)  # a new job step count is fine: the workers' clocks go on
        _same_state(c.stores[0], fresh)
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
    _train(c.addresses, _model(), 3)
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


# -- kill -9 ------------------------------------------------------------------------------------------


def _kill_at(cluster, victim: int, worker: int, at_step: int) -> Callable[[int, int, object], None]:
    """An on_step hook: SIGKILL server ``victim`` when ``worker`` has done ``at_step`` steps.

    An exact point of that worker's run; the other worker may be anywhere in its
    own step then (mid-push, waiting at the barrier), which is what a crash does.
    """

    def on_step(k: int, step: int, client: object) -> None:
        if k == worker and step == at_step:
            cluster.kill(victim)

    return on_step


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_kill_9_a_primary_mid_training_and_the_result_is_exact(make_cluster):
    """bsp: the backup takes over, and the final weights equal a run without the fault, bit for bit."""
    steps = 20
    base = _big_model()
    clean = _train(make_cluster(2).addresses, base, steps, part_bytes=None)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        got = _train(c.addresses, base, steps, part_bytes=None, on_step=_kill_at(c, 1, 0, 7))
        for (exp, _), (res, failovers) in zip(clean, got):
            assert failovers == 1
            for n in exp:
                assert torch.equal(res[n], exp[n]), n
        with shardps.connect(c.serving_addresses()) as client:
            stats = client.stats()
    assert [s["version"] for s in stats] == [steps, steps]
    assert stats[1]["role"] == "primary" and stats[0]["replica_state"] == "degraded"
    assert all(s["worker_clocks"] == {0: steps - 1, 1: steps - 1} for s in stats)


@pytest.mark.cluster
@pytest.mark.fault
@pytest.mark.timeout(300)
def test_kill_9_under_asp_every_acknowledged_gradient_is_applied_once():
    steps = 30
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        _train(c.addresses, _model(), steps, sync="asp", on_step=_kill_at(c, 0, 0, 12))
        with shardps.connect(c.serving_addresses()) as client:
            stats = client.stats()
    for s in stats:  # each of the 2 x 30 pushes acknowledged by each shard is in its weights, once
        assert s["gradients_applied_total"] == W * steps and s["version"] == W * steps
        assert s["worker_clocks"] == {0: steps - 1, 1: steps - 1}
    assert stats[0]["role"] == "primary"


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_workers_that_start_after_a_primary_died_go_to_its_backup(make_cluster):
    base, steps = _model(), 6
    clean = _train(make_cluster(2).addresses, base, steps)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        c.kill(0)  # before any worker registered: they cannot learn the backup from shard 0
        with pytest.raises(TimeoutError, match="no parameter server answered"):
            shardps.connect(c.addresses, ready_timeout=1)
        got = _train(c.addresses, base, steps, backups=c.backup_addresses)
    for (exp, _), (res, failovers) in zip(clean, got):
        assert failovers == 1
        for n in exp:
            assert torch.equal(res[n], exp[n]), n


@pytest.mark.cluster
@pytest.mark.fault
def test_demo_failover_drill():
    p = subprocess.run([sys.executable, "-m", "shardps", "demo", "--replicas", "2", "--kill-server", "1",
                        "--kill-at-step", "20", "--epochs", "6", "--json", "--quiet"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["replicas"] == 2 and summary["failovers"] == 2  # both workers moved to the backup
    assert summary["test_accuracy"] > 0.9


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_fixed(ports: list[int], i: int) -> subprocess.Popen:
    """Server i of 2 on ports[i], holding the previous shard's backup on ports[2 + i], as on a real cluster."""
    from shardps.deploy.local import read_ready

    cmd = [sys.executable, "-m", "shardps", "server", "--port", str(ports[i]), "--shard-index", str(i),
           "--num-shards", "2", "--replicas", "2", "--replica-port", str(ports[2 + i]),
           "--replica-target", f"127.0.0.1:{ports[2 + (i + 1) % 2]}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    read_ready(proc, 60)
    return proc


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_killed_server_restarted_at_its_address_does_not_serve_its_old_shard(make_cluster):
    """Fixed ports, as on a real cluster: kill -9 server 1, its backup on server 0 takes over; server 1
    restarted with the same flags learns that from its backup and stays away from shard 1, while it
    becomes shard 0's backup again. The run is exact throughout."""
    from shardps.deploy.local import stop_processes

    ports = [_free_port() for _ in range(4)]  # server 0, server 1, their replica ports

    def start(i: int) -> subprocess.Popen:
        return _start_fixed(ports, i)

    addresses = [f"127.0.0.1:{p}" for p in ports[:2]]
    base, steps = _model(), 16
    clean = _train(make_cluster(2).addresses, base, steps)
    procs = [start(0), start(1)]
    try:
        with shardps.connect(addresses[:1]) as c:  # both backups in sync before the workers start
            deadline = time.monotonic() + 30
            while c.stats()[0]["replica_state"] != "synced":
                assert time.monotonic() < deadline
                time.sleep(0.05)  # polling another process
        restarted = threading.Event()

        def on_step(k, step, client):
            if k == 0 and step == 5:
                procs[1].kill()
                procs[1].wait(timeout=30)
            if k == 0 and step == 8:
                procs[1].stdout.close()
                procs[1] = start(1)
                restarted.set()

        got = _train(addresses, base, steps, on_step=on_step)
        assert restarted.is_set()
        for (exp, _), (res, failovers) in zip(clean, got):
            assert failovers == 1
            for n in exp:
                assert torch.equal(res[n], exp[n]), n
        with shardps.connect([addresses[1]]) as c:
            assert c.stats()[0]["role"] == "deposed"
        with shardps.connect(addresses[:1]) as c:  # shard 0 re-attached to the restarted server's backup
            deadline = time.monotonic() + 30
            while c.stats()[0]["replica_state"] != "synced":
                assert time.monotonic() < deadline
                time.sleep(0.05)  # polling another process; the primary retries every 2 s
    finally:
        stop_processes(procs)


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_primary_restarted_before_anyone_noticed_does_not_overwrite_its_backup(make_cluster):
    """kill -9 server 1 and restart it at once (empty, before a worker saw it gone): its backup holds
    acknowledged updates the new run lacks, so it refuses the new run's state, the new run stays out of
    service, and the workers move to the backup: nothing is lost."""
    from shardps.deploy.local import stop_processes

    ports = [_free_port() for _ in range(4)]

    def start(i: int) -> subprocess.Popen:
        return _start_fixed(ports, i)

    addresses = [f"127.0.0.1:{p}" for p in ports[:2]]
    base, steps = _model(), 12
    clean = _train(make_cluster(2).addresses, base, steps)
    procs = [start(0), start(1)]
    try:
        def on_step(k, step, client):
            if k == 0 and step == 5:  # between two steps of worker 0; worker 1 may be anywhere
                procs[1].kill()
                procs[1].wait(timeout=30)
                procs[1].stdout.close()
                procs[1] = start(1)

        got = _train(addresses, base, steps, on_step=on_step)
        for (exp, _), (res, failovers) in zip(clean, got):
            assert failovers == 1
            for n in exp:
                assert torch.equal(res[n], exp[n]), n
        with shardps.connect([addresses[1]]) as c:
            s = c.stats()[0]
        assert s["role"] == "deposed" and s["version"] == 0  # the new run never took anything in
    finally:
        stop_processes(procs)


def test_a_backup_refuses_the_state_of_another_run_of_its_primary(make_cluster):
    c = make_cluster(2, replicas=2)
    _train(c.addresses, _model(), 3)
    backup = {b.shard_index: b for b in c.backups}[0]
    impostor = ShardStore(0, 2)  # shard 0 as a restarted, empty primary would hold it
    server, port = create_server(impostor)
    try:
        assert impostor.attach_replica(c.replica_addresses[1], timeout=10) == "deposed"
        assert "holds the state of an earlier run of its primary" in impostor.replicator.last_error
        assert impostor.role == "deposed"
        _same_state(c.stores[0], backup)  # the copy is intact, and the real primary goes on replicating
        _train(c.addresses, _model(), 2)
        _same_state(c.stores[0], backup)
    finally:
        impostor.stop_replication()
        stop_server(server)


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_spare_gives_a_taken_over_shard_a_copy_again(make_cluster):
    """kill -9 server 1 (shard 1 moves to server 0), start a spare for shard 1 (`--backup-only 1`), attach
    it; it holds an exact copy, and it can take the shard over in turn: the run is still exact."""
    from shardps.deploy.local import read_ready, ready_field, stop_processes

    base, steps = _model(), 14
    clean = _train(make_cluster(2).addresses, base, steps)
    spare: list[subprocess.Popen] = []
    spare_address: list[str] = []
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        try:
            def on_step(k, step, client):
                if k == 0 and step == 3:
                    c.kill(1)
                if k == 0 and step == 6:
                    proc = subprocess.Popen([sys.executable, "-m", "shardps", "server", "--backup-only", "1",
                                             "--num-shards", "2"], stdout=subprocess.PIPE, text=True)
                    spare.append(proc)
                    spare_address.append(ready_field(read_ready(proc, 60), "replica"))
                    out = io.StringIO()
                    assert run_attach_replica(c.serving_addresses(), 1, spare_address[0], out=out) == 0, \
                        out.getvalue()
                if k == 0 and step == 9:  # the spare takes shard 1 over; the workers follow it
                    assert run_promote(spare_address, force=True, out=io.StringIO()) == 0

            got = _train(c.addresses, base, steps, on_step=on_step)
        finally:
            stop_processes(spare)
    for (exp, _), (res, failovers) in zip(clean, got):
        assert failovers == 2
        for n in exp:
            assert torch.equal(res[n], exp[n]), n


def test_requests_that_change_nothing_send_the_backup_nothing(make_cluster):
    """Found by benchmarks/fuzz.py --replicas 2: every Register of a registered worker was an op."""
    c = make_cluster(2, replicas=2)
    with shardps.connect(c.addresses) as client:
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=0.1), sync="bsp")
        ops = [s.stats().replicated_ops_total for s in c.stores]
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=0.1), sync="bsp")  # again: a no-op
        client.set_sync("bsp")
        client.pull()
        assert [s.stats().replicated_ops_total for s in c.stores] == ops
