"""--replicas 2 under kill -9: a primary killed mid-training, restarted, or found dead by late workers; its
backup takes over, and nothing a worker was told is taken in is lost. (The rest: test_replication.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardps
from shardps.admin import run_attach_replica, run_promote
from shardps.server.coordinator import LocalEtcd
from shardps.server.service import create_server, stop_server
from shardps.server.store import ShardStore
from tests.helpers import ETCD_MISSING, chosen_port, shardps_process
from tests.replicas import W, big_model, model, same_state, train

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


def _replicated(stack: contextlib.ExitStack, coordinator: bool, job: str) -> tuple[shardps.LocalCluster, Any]:
    """A --replicas 2 cluster of 2 server processes entered on ``stack``; with ``coordinator``, fenced through a
    LocalEtcd (returned too, else None) under ``job`` (skipped, saying why, without etcd)."""
    kw: dict[str, Any] = {}
    etcd = None
    if coordinator:
        if shutil.which("etcd") is None:
            pytest.skip(ETCD_MISSING)
        etcd = stack.enter_context(LocalEtcd())
        kw = {"coordinator": etcd.url, "job": job, "coordinator_ttl": 2}
    return stack.enter_context(shardps.LocalCluster(2, processes=True, replicas=2, **kw)), etcd


@pytest.mark.fault
@pytest.mark.timeout(300)
@pytest.mark.parametrize("coordinator", [False, True], ids=["alone", "etcd"])
def test_kill_9_a_primary_mid_training_and_the_result_is_exact(make_cluster, coordinator):
    """bsp: the backup takes over (with --coordinator, once etcd let the dead primary's lease expire), and the
    final weights equal a run without the fault, bit for bit."""
    steps = 20
    base = big_model()
    clean = train(make_cluster(2).addresses, base, steps, part_bytes=None)
    with contextlib.ExitStack() as stack:
        c, _ = _replicated(stack, coordinator, "kill9bsp")
        got = train(c.addresses, base, steps, part_bytes=None, on_step=_kill_at(c, 1, 0, 7))
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
@pytest.mark.parametrize("coordinator", [False, True], ids=["alone", "etcd"])
def test_kill_9_under_asp_every_acknowledged_gradient_is_applied_once(coordinator):
    """With --coordinator: the backup takes over only once etcd let the dead primary's lease expire."""
    steps = 30
    with contextlib.ExitStack() as stack:
        c, etcd = _replicated(stack, coordinator, "kill9asp")
        train(c.addresses, model(), steps, sync="asp", on_step=_kill_at(c, 0, 0, 12))
        with shardps.connect(c.serving_addresses()) as client:
            stats = client.stats()
        if etcd is not None:
            from shardps.server.coordinator import Etcd, ShardLease

            client = Etcd(etcd.endpoints)
            try:
                assert [ShardLease(client, "kill9asp", i, "observer:0").read().epoch for i in (0, 1)] == [2, 1]
            finally:
                client.close()
    for s in stats:  # each of the 2 x 30 pushes acknowledged by each shard is in its weights, once
        assert s["gradients_applied_total"] == W * steps and s["version"] == W * steps
        assert s["worker_clocks"] == {0: steps - 1, 1: steps - 1}
    assert stats[0]["role"] == "primary"


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_workers_that_start_after_a_primary_died_go_to_its_backup(make_cluster):
    base, steps = model(), 6
    clean = train(make_cluster(2).addresses, base, steps)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        c.kill(0)  # before any worker registered: they cannot learn the backup from shard 0
        with pytest.raises(TimeoutError, match="no parameter server answered"):
            shardps.connect(c.addresses, ready_timeout=1)
        got = train(c.addresses, base, steps, backups=c.backup_addresses)
    for (exp, _), (res, failovers) in zip(clean, got):
        assert failovers == 1
        for n in exp:
            assert torch.equal(res[n], exp[n]), n


@pytest.mark.cluster
@pytest.mark.fault
def test_demo_failover_drill():
    p = subprocess.run([sys.executable, "-m", "shardps", "demo", "--replicas", "2", "--kill-server", "1",
                        "--kill-at-step", "20", "--epochs", "3", "--json", "--quiet"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["replicas"] == 2 and summary["failovers"] == 2  # both workers moved to the backup
    assert summary["test_accuracy"] > 0.9  # 0.9278 after 3 epochs, as without the kill (2026-12-04)


def _free_port() -> int:
    """A port the test's server is restarted at (``chosen_port``: no client's connect can take it meanwhile)."""
    return chosen_port()


def _start_fixed(ports: list[int], i: int) -> subprocess.Popen:
    """Server i of 2 on ports[i], holding the previous shard's backup on ports[2 + i], as on a real cluster."""
    from shardps.deploy.local import read_ready

    proc = shardps_process("server", "--port", str(ports[i]), "--shard-index", str(i),
                           "--num-shards", "2", "--replicas", "2", "--replica-port", str(ports[2 + i]),
                           "--replica-target", f"127.0.0.1:{ports[2 + (i + 1) % 2]}")
    read_ready(proc, 60)
    return proc


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_killed_server_restarted_at_its_address_does_not_serve_its_old_shard(make_cluster):
    """Fixed ports, as on a real cluster: kill -9 server 1, its backup on server 0 takes over; server 1
    restarted with the same flags learns that from its backup and stays away from shard 1, while it
    becomes shard 0's backup again. The run is exact throughout."""
    from shardps.deploy.local import stop_processes

    base, steps = model(), 16
    clean = train(make_cluster(2).addresses, base, steps)
    # Chosen once the reference cluster holds its own ports (the kernel could give it one chosen before).
    ports = [_free_port() for _ in range(4)]  # server 0, server 1, their replica ports

    def start(i: int) -> subprocess.Popen:
        return _start_fixed(ports, i)

    addresses = [f"127.0.0.1:{p}" for p in ports[:2]]
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

        got = train(addresses, base, steps, on_step=on_step)
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

    base, steps = model(), 12
    clean = train(make_cluster(2).addresses, base, steps)
    # Chosen once the reference cluster holds its own ports: a port chosen before could be the one the kernel
    # gives that cluster next (seen under load: its shard 0 on the restarted server's replica port).
    ports = [_free_port() for _ in range(4)]

    def start(i: int) -> subprocess.Popen:
        return _start_fixed(ports, i)

    addresses = [f"127.0.0.1:{p}" for p in ports[:2]]
    procs = [start(0), start(1)]
    try:
        def on_step(k, step, client):
            if k == 0 and step == 5:  # between two steps of worker 0; worker 1 may be anywhere
                procs[1].kill()
                procs[1].wait(timeout=30)
                procs[1].stdout.close()
                procs[1] = start(1)

        got = train(addresses, base, steps, on_step=on_step)
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
    train(c.addresses, model(), 3)
    backup = {b.shard_index: b for b in c.backups}[0]
    impostor = ShardStore(0, 2)  # shard 0 as a restarted, empty primary would hold it
    server, port = create_server(impostor)
    try:
        assert impostor.replica.attach_replica(c.replica_addresses[1], timeout=10) == "deposed"
        assert "holds the state of an earlier run of its primary" in impostor.replica.replicator.last_error
        assert impostor.replica.role == "deposed"
        same_state(c.stores[0], backup)  # the copy is intact, and the real primary goes on replicating
        train(c.addresses, model(), 2)
        same_state(c.stores[0], backup)
    finally:
        impostor.replica.stop_replication()
        stop_server(server)


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_spare_gives_a_taken_over_shard_a_copy_again(make_cluster):
    """kill -9 server 1 (shard 1 moves to server 0), start a spare for shard 1 (`--backup-only 1`), attach
    it; it holds an exact copy, and it can take the shard over in turn: the run is still exact."""
    from shardps.deploy.local import read_ready, ready_field, stop_processes

    base, steps = model(), 14
    clean = train(make_cluster(2).addresses, base, steps)
    spare: list[subprocess.Popen] = []
    spare_address: list[str] = []
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        try:
            def on_step(k, step, client):
                if k == 0 and step == 3:
                    c.kill(1)
                if k == 0 and step == 6:
                    proc = shardps_process("server", "--backup-only", "1", "--num-shards", "2")
                    spare.append(proc)
                    spare_address.append(ready_field(read_ready(proc, 60), "replica"))
                    out = io.StringIO()
                    assert run_attach_replica(c.serving_addresses(), 1, spare_address[0], out=out) == 0, \
                        out.getvalue()
                if k == 0 and step == 9:  # the spare takes shard 1 over; the workers follow it
                    assert run_promote(spare_address, force=True, out=io.StringIO()) == 0

            got = train(c.addresses, base, steps, on_step=on_step)
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
