"""kill -9 a server of a job whose model has an MoE layer with its experts on the servers, restart it: the
job rolls back to a common checkpoint and finishes with the same weights, experts included, as a run
without the fault. The experts are rows (checkpointed as any row table); under "send" the restarted shard
has no expert program until the layer registers it again."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import threading
import time

import grpc
import pytest
import torch
from torch import nn

import shardps
from tests.helpers import run_workers
from tests.test_moe import D, E, expert
from tests.test_recovery import Parking, _free_port, _server

pytestmark = pytest.mark.cluster

STEPS, WORKERS = 14, 2


class Net(nn.Module):
    def __init__(self, placement: str) -> None:
        super().__init__()
        self.inp = nn.Linear(6, D)
        self.moe = shardps.nn.MoE(D, E, expert, name="experts", placement=placement, drop_tokens=False,
                                  optimizer=shardps.optim.SGD(lr=0.05))
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h), aux


def _train(addresses, placement, rollbacks, park=None):
    torch.manual_seed(0)
    base = Net(placement)

    def worker(k):
        model = copy.deepcopy(base)
        with shardps.connect(addresses, worker_id=k, num_workers=WORKERS, part_bytes=512,
                             recovery_timeout=120) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.05), sync="bsp")
            step = 0
            while step < STEPS:
                if park is not None:
                    park(k, step)
                try:
                    g = torch.Generator().manual_seed(step * 10 + k)
                    out, aux = model(torch.randn(8, 6, generator=g))
                    (out.pow(2).mean() + aux).backward()
                    opt.step()
                    opt.zero_grad()
                    step += 1
                except shardps.RolledBack as e:
                    opt.zero_grad()
                    rollbacks.append((k, step, e.step))
                    step = e.step
            dense = {n: p.detach().clone() for n, p in model.named_parameters()}
            return dense, client.pull_rows("experts", torch.arange(E), track=False)
    return run_workers(worker, WORKERS, timeout=240)


@pytest.mark.fault
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["pull", "send"])
def test_kill_9_a_server_of_an_moe_job_restart_it_and_the_run_finishes_exactly(tmp_path, placement, make_cluster):
    ports = [_free_port(), _free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = [_server(ports[i], i, tmp_path / "faulty") for i in range(2)]
    try:
        expected = _train(make_cluster(2).addresses, placement, [])  # without a fault, servers in this process
        parking = Parking(12, WORKERS)  # checkpoints at 5 and 10 are on disk: rolls back to 10

        def killer():
            parking.wait_parked()
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(timeout=30)
            procs[1].stdout.close()
            procs[1] = _server(ports[1], 1, tmp_path / "faulty")  # same address, restores version 10
            parking.released.set()

        t = threading.Thread(target=killer)
        t.start()
        rollbacks: list[tuple[int, int, int]] = []
        try:
            got = _train(addresses, placement, rollbacks, park=parking)
        finally:
            parking.released.set()
            t.join(timeout=120)
        assert {k for k, _, _ in rollbacks} == {0, 1} and all(to == 10 for _, _, to in rollbacks), rollbacks
        for (dense_want, rows_want), (dense_got, rows_got) in zip(expected, got):
            for n in dense_want:
                assert torch.equal(dense_got[n], dense_want[n]), n
            assert torch.equal(rows_got, rows_want)
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


@pytest.mark.parametrize("placement", ["pull", "send"])
def test_an_expert_step_computed_before_a_rollback_applies_nothing(make_cluster, tmp_path, placement):
    """A worker still in the epoch before a rollback (another worker rolled the job back) pushes its experts'
    gradients ("pull": PushRows at the step; "send": the shards' Backward): the shards apply nothing of
    them, and the step raises RolledBack, so the worker replays it. Found by make test: two workers that
    recover at once roll back twice, and the first epoch's replay reached the expert table of the second."""
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    torch.manual_seed(0)
    model = Net(placement)
    with shardps.connect(cluster.addresses, part_bytes=512) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.05), sync="bsp")
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            out, aux = model(x)
            (out.pow(2).mean() + aux).backward()
            opt.step()
            opt.zero_grad()
        before = client.pull_rows("experts", torch.arange(E), track=False)
        for store in cluster.stores:  # another worker's rollback to the last checkpoint, in a new epoch
            store.rollback(store.job.version, client.epoch + 1)
        out, aux = model(x)
        (out.pow(2).mean() + aux).backward()  # "send": the shards' Backward, refused to apply
        assert torch.equal(client.pull_rows("experts", torch.arange(E), track=False), before)
        with pytest.raises(shardps.RolledBack) as e:
            opt.step()
        assert e.value.step == 2 and client.epoch == 1
        assert torch.equal(client.pull_rows("experts", torch.arange(E), track=False), before)
        opt.zero_grad()
        out, aux = model(x)
        (out.pow(2).mean() + aux).backward()
        opt.step()  # the replay applies
        assert not torch.equal(client.pull_rows("experts", torch.arange(E), track=False), before)


def test_a_row_pull_waiting_for_a_round_is_ended_by_a_rollback_aborted(make_cluster, tmp_path):
    """A worker's PullRows that waits for its push's round (bsp, the other worker's push not in) when another
    worker rolls the job back: the round will not come (the tables are the checkpoint's), so the wait ends at
    once, ABORTED (the optimizer then rolls back: ``pull_failed``), not at its deadline. The pull says its
    epoch; a pull that waits for nothing does not. Found by tests.stress: kill -9 of an MoE job's server, one
    worker's forward waited 108.9 s for a round of the epoch before."""
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2, timeout=60.0) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=0.1))
        client.register_rows("t", 4)
        for store in cluster.stores:
            store.checkpoint_now()  # version 0: what the rollback below goes back to
        keys = torch.arange(8)
        client.push_rows("t", keys, torch.ones(8, 4), 0, num_workers=2, sync="bsp")  # worker 1's never comes
        assert any(r for r, _ in client.rows.waits("t"))
        stores = cluster.stores
        failed: list[BaseException] = []

        def pull() -> None:
            try:
                client.rows.pull("t", keys)
            except BaseException as e:  # noqa: BLE001 - looked at below
                failed.append(e)

        t = threading.Thread(target=pull)
        t0 = time.monotonic()
        t.start()
        for store in stores:  # both shards' pulls are waiting (the exact point), then the rollback
            with store.rows.lock:
                assert store.rows.lock.wait_for(lambda s=store: s.rows.waiting >= 1, timeout=60)
        for store in stores:
            store.rollback(store.job.version, client.epoch + 1)
        t.join(60)
        assert not t.is_alive() and failed and time.monotonic() - t0 < 30
        e = failed[0]
        assert isinstance(e, shardps.ShardError) and e.code == grpc.StatusCode.ABORTED, e
        assert "rolled back" in e.details


def test_a_row_push_waiting_for_its_last_round_is_ended_by_a_rollback_aborted(make_cluster, tmp_path):
    """As a waiting pull: a push of step 1 waits (bsp) for the round of the worker's step 0, which the other
    worker never completes; a rollback meanwhile ends it at once, ABORTED, and no row changes."""
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2, timeout=60.0) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=0.1))
        client.register_rows("t", 4)
        for store in cluster.stores:
            store.checkpoint_now()
        keys = torch.arange(8)
        before = client.pull_rows("t", keys, track=False)
        client.push_rows("t", keys, torch.ones(8, 4), 0, num_workers=2, sync="bsp")  # worker 1's never comes
        failed: list[BaseException] = []

        def push() -> None:
            try:
                client.push_rows("t", keys, torch.ones(8, 4), 1, num_workers=2, sync="bsp")
            except BaseException as e:  # noqa: BLE001 - looked at below
                failed.append(e)

        t = threading.Thread(target=push)
        t0 = time.monotonic()
        t.start()
        for store in cluster.stores:  # both shards' pushes are waiting (the exact point), then the rollback
            with store.rows.lock:
                assert store.rows.lock.wait_for(lambda s=store: s.rows.waiting >= 1, timeout=60)
        for store in cluster.stores:
            store.rollback(store.job.version, client.epoch + 1)
        t.join(60)
        assert not t.is_alive() and failed and time.monotonic() - t0 < 30
        e = failed[0]
        assert isinstance(e, shardps.ShardError) and e.code == grpc.StatusCode.ABORTED, e
    with shardps.connect(cluster.addresses) as reader:  # owes no round: reads what the shards hold
        reader.register_rows("t", 4)
        assert torch.equal(reader.pull_rows("t", keys, track=False), before)  # the checkpoint's rows
