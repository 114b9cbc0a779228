"""kill -9 a server mid-training, restart it: the job rolls back to a common checkpoint and finishes
with the same weights as a run without the fault."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import threading

import pytest
import torch
from torch import nn

import shardps
from shardps.deploy.local import read_ready
from tests.helpers import chosen_port, run_workers, shardps_process

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast

STEPS, WORKERS, EVERY = 20, 2, 5


def _free_port() -> int:
    """A port the test's server is restarted at (``chosen_port``: no client's connect can take it meanwhile)."""
    return chosen_port()


def _server(port: int, shard: int, ckpt, every: int = EVERY) -> subprocess.Popen:
    proc = shardps_process("server", "--port", str(port), "--shard-index", str(shard), "--num-shards", "2",
                           "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every), "--lease-seconds", "60")
    read_ready(proc, 60)
    return proc


def _train(addresses, rollbacks, park=None):
    """WORKERS workers in threads; ``park(k, step)`` is called before every step (fault injection)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))

    def worker(k):
        model = copy.deepcopy(base)  # not torch.manual_seed in threads: the global generator is shared
        with shardps.connect(addresses, worker_id=k, num_workers=WORKERS, part_bytes=512,
                             recovery_timeout=120) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp")
            step = 0
            while step < STEPS:
                if park is not None:
                    park(k, step)
                try:
                    g = torch.Generator().manual_seed(step * 10 + k)
                    model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    step += 1
                except shardps.RolledBack as e:
                    opt.zero_grad()
                    rollbacks.append((k, step, e.step))
                    step = e.step
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return run_workers(worker, WORKERS, timeout=240)


class Parking:
    """Parks every worker before its step ``at`` (once), so a fault lands at an exact version.

    Under bsp, with every worker parked before step ``at``, each shard is at
    version ``at`` exactly and has written its checkpoints of the versions
    before it (a checkpoint is written before the push that completed its
    round returns).
    """

    def __init__(self, at: int, workers: int) -> None:
        self.at = at
        self.arrived = threading.Barrier(workers + 1)
        self.released = threading.Event()
        self.done: set[int] = set()

    def __call__(self, k: int, step: int) -> None:
        if step == self.at and k not in self.done:
            self.done.add(k)
            self.arrived.wait(timeout=120)
            assert self.released.wait(timeout=120), "never released"

    def wait_parked(self) -> None:
        self.arrived.wait(timeout=120)


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_kill_9_a_server_restart_it_and_the_run_finishes_exactly(tmp_path, make_cluster):
    ports = [_free_port(), _free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = [_server(ports[i], i, tmp_path / "faulty") for i in range(2)]
    try:
        expected = _train(make_cluster(2).addresses, [])  # the run without a fault, servers in this process

        parking = Parking(12, WORKERS)  # checkpoints at 5 and 10 are on disk, 15 is not: rolls back to 10

        def killer():
            parking.wait_parked()
            with shardps.connect(addresses) as watch:
                assert [s["version"] for s in watch.stats()] == [12, 12]
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(timeout=30)
            procs[1].stdout.close()
            procs[1] = _server(ports[1], 1, tmp_path / "faulty")  # same address, restores version 10
            parking.released.set()

        t = threading.Thread(target=killer)
        t.start()
        rollbacks: list[tuple[int, int, int]] = []
        try:
            got = _train(addresses, rollbacks, park=parking)
        finally:
            parking.released.set()
            t.join(timeout=120)
        assert parking.released.is_set() and not t.is_alive()
        # Each worker rolled back to 10. (Two workers that recover at once may each start a rollback:
        # then the second one takes both shards back to 10 again, in the next epoch; still exact.)
        assert {k for k, _, _ in rollbacks} == {0, 1}, rollbacks
        assert all(to == 10 for _, _, to in rollbacks), rollbacks
        for (k, exp), res in zip(enumerate(expected), got):
            for n in exp:
                assert torch.equal(res[n], exp[n]), (k, n)
        with shardps.connect(addresses) as c:
            stats = c.stats()
        assert stats[0]["epoch"] == stats[1]["epoch"] >= 1 and [s["version"] for s in stats] == [STEPS, STEPS]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            if p.stdout and not p.stdout.closed:
                p.stdout.close()


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_cli_workers_go_on_after_the_job_rolls_back(tmp_path):
    """Two `shardps worker` processes; server 1 is killed with -9 and restarted: the job rolls back to
    step 20 and both workers go on from there to the end (they used to exit 1 on RolledBack).

    The fault lands at an exact step: a third worker in this test paces the bsp job. It pushes zero
    gradients and stops before its step 25, so every shard is at version 25 exactly when server 1 is
    killed (checkpoints every 20 steps: 20 is on disk, 40 is not)."""
    from shardps.examples.digits import make_model, make_spec

    ports = [_free_port(), _free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    servers = [_server(ports[i], i, tmp_path, every=20) for i in range(2)]
    workers = [shardps_process("worker", "--example", "digits", "--addresses", ",".join(addresses),
                               "--worker-id", str(k), "--num-workers", "3", "--epochs", "3", stderr=subprocess.PIPE)
               for k in range(2)]
    try:
        model = make_model(0)
        with shardps.connect(addresses, worker_id=2, num_workers=3, recovery_timeout=120) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=make_spec("adam"), sync="bsp")
            step, rolled_back = 0, []
            while step < 30:
                if step == 25 and not rolled_back:
                    with shardps.connect(addresses) as watch:
                        assert [s["version"] for s in watch.stats()] == [25, 25]
                    servers[1].kill()
                    servers[1].wait(timeout=30)
                    servers[1].stdout.close()
                    servers[1] = _server(ports[1], 1, tmp_path, every=20)  # restores step 20
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                try:
                    opt.step()
                    step += 1
                except shardps.RolledBack as e:
                    rolled_back.append(e.step)
                    step = e.step
            assert rolled_back and set(rolled_back) == {20}, rolled_back
        # This worker has left: the two CLI workers finish the job on their own.
        outs = [w.communicate(timeout=180) for w in workers]
        for w, (out, err) in zip(workers, outs):
            assert w.returncode == 0, err[-3000:]
            result = json.loads(out.strip().splitlines()[-1])
            assert result["rollbacks"] >= 1 and result["steps"] == 3 * (1437 // 64), result
            assert "RolledBack" not in err
    finally:
        for p in workers + servers:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)


def test_a_worker_goes_on_from_the_lowest_step_any_shard_expects(make_cluster):
    """A push that reached one shard and not the other (a crash between them, or one shard's
    checkpoint taken just after a fast worker's next push came in): the worker must send that step
    again, not skip it. It used to go on from the highest step any shard had, which left the other
    shard waiting for a step that never came. Duplicates are acknowledged, not applied twice."""
    from shardps.protos.shardps.v1 import ps_pb2
    from shardps.testing.frames import FrameStub

    cluster = make_cluster(2)
    params = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=16) as c:
        c.register(params, shardps.optim.SGD(lr=1.0), sync="bsp")
        c.push({n: torch.ones(4) for n in params}, step=0)  # both shards: version 1
        [shard0_name] = [p.name for p in c.shard_map.parts if p.server == 0]
        chunk = ps_pb2.Chunk(name=shard0_name, offset=0, dtype=ps_pb2.FLOAT32, data=torch.ones(4).numpy().tobytes())
        with FrameStub(cluster.addresses[0]) as stub:  # step 1 reaches shard 0 only
            stub.Push([ps_pb2.PushRequest(worker_id=0, step=1, base_version=1, chunk=chunk)], timeout=10)
        assert c.recover() == 1  # not 2
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=16) as c:
        c.register(params, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert c.clock == 1
        results = c.push({n: torch.ones(4) for n in params}, step=c.clock)
        assert [r.duplicate for r in results] == [True, False]
        got = c.pull()
    assert all(torch.equal(t, torch.full((4,), -2.0)) for t in got.values())  # each step applied once


def test_a_second_rollback_while_a_worker_resyncs_is_followed(make_cluster, tmp_path):
    """Found by make stress: two workers that recover at once may each start a rollback (epochs 1 and
    2). A worker whose pull met the second one got ABORTED out of its recovery, uncaught; now it
    resyncs again and goes on."""
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with shardps.connect(cluster.addresses, part_bytes=16) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
        for _ in range(4):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        cluster.stores[1].job.recovering = True  # shard 1 restarted from its checkpoint at 4
        real_pull, calls = client.pull, []

        def pull(*args, **kwargs):
            if not calls:  # between this worker's rollback and its pull, another worker rolls back again
                calls.append(1)
                cluster.stores[0].rollback(4, client.epoch + 1)
            return real_pull(*args, **kwargs)

        client.pull = pull
        model(torch.ones(1, 4)).sum().backward()
        with pytest.raises(shardps.RolledBack) as e:
            opt.step()
        assert e.value.step == 4 and calls == [1]
        stats = client.stats()
        assert [s["epoch"] for s in stats] == [2, 2] and client.epoch == 2
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()  # and training goes on
        assert [s["version"] for s in client.stats()] == [5, 5]


def test_a_rollback_restores_the_state_and_enters_its_epoch_at_once(make_cluster, tmp_path):
    """A live shard rolled back used to restore the checkpoint and then, in a second hold of its lock,
    enter the new epoch: in between, a request of the old epoch passed its epoch check against the
    restored state (a push taken in there outlived the rollback). Every change the shard's waiters are
    told of now shows the restored version only with the new epoch."""
    cluster = make_cluster(1, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    params = {"w": torch.zeros(4)}
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=16) as c:
        c.register(params, shardps.optim.SGD(lr=1.0), sync="bsp")
        for step in range(3):
            c.push({"w": torch.ones(4)}, step=step)
        store = cluster.stores[0]
        assert store.job.version == 3 and store.job.epoch == 0
        seen: list[tuple[int, int]] = []
        store._cond.hooks.append(lambda: seen.append((store.job.version, store.job.epoch)))
        assert store.rollback(2, 1) == (2, 1)
        assert seen and all(epoch == 1 for version, epoch in seen if version == 2), seen
        assert c.recover() == 2  # the worker follows, and the shard takes the step again
        c.push({"w": torch.ones(4)}, step=2)
        assert torch.equal(c.pull()["w"], torch.full((4,), -3.0))


def test_after_a_rollback_a_pull_on_the_data_connection_gets_the_restored_weights(make_cluster, tmp_path):
    """Pulls on the data connection share one copy of a version's weights (``Reader.read_shared``), kept
    until a step changes them. A rollback changes them too: the copy of the version before it used to
    answer the next Pull (the weights of version 3, saying version 3, after a rollback to 2)."""
    cluster = make_cluster(1, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    params = {"w": torch.zeros(4)}
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=16, shm=False) as c:
        c.register(params, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert {type(p).__name__ for p in c.paths} == {"ConnPath"}
        for step in range(3):
            c.push({"w": torch.ones(4)}, step=step)
        assert torch.equal(c.pull()["w"], torch.full((4,), -3.0)) and c.versions == [3]
        assert cluster.stores[0].rollback(2, 1) == (2, 1)
        assert c.recover() == 2
        assert torch.equal(c.pull()["w"], torch.full((4,), -2.0)) and c.versions == [2]
