"""Checkpoints: periodic under bsp (same versions on every shard), on request, on SIGTERM; restore on start."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from torch import nn

import shardps
from shardps.server import checkpoint as ck
from tests.helpers import run_workers


def _train(addresses, steps, workers=2, start=0):
    def worker(k):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 2))
        with shardps.connect(addresses, worker_id=k, num_workers=workers, part_bytes=256) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp")
            assert opt.round == start  # a restarted job tells each worker where it was
            for step in range(start, start + steps):
                g = torch.Generator().manual_seed(step * 10 + k)
                model(torch.randn(6, 10, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return run_workers(worker, workers)


def test_periodic_checkpoints_land_on_the_same_versions(make_cluster, tmp_path):
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    _train(cluster.addresses, 12)
    assert ck.list_versions(tmp_path, 0) == ck.list_versions(tmp_path, 1) == [5, 10]
    with shardps.connect(cluster.addresses) as client:
        assert [s["checkpoint_versions"] for s in client.stats()] == [[5, 10], [5, 10]]
        written = client.checkpoint()  # on request
    assert [v for v, _ in written] == [12, 12]
    assert ck.list_versions(tmp_path, 0) == [5, 10, 12]


@pytest.mark.fault
def test_sigterm_checkpoints_and_a_restart_restores_everything(make_cluster, tmp_path):
    cluster = make_cluster(2, processes=True, checkpoint_dir=str(tmp_path))
    weights = _train(cluster.addresses, 7)[0]
    with shardps.connect(cluster.addresses) as client:
        client.attach()
        before = client.pull()
        stats_before = client.stats()
    procs = list(cluster._procs)
    cluster.stop(grace=120.0)  # SIGTERM; SIGKILL only past a grace no loaded machine reaches
    assert [p.returncode for p in procs] == [0, 0]
    assert ck.list_versions(tmp_path, 0) == ck.list_versions(tmp_path, 1) == [7]

    again = make_cluster(2, processes=True, checkpoint_dir=str(tmp_path))
    with shardps.connect(again.addresses) as client:
        client.attach()
        with pytest.raises(shardps.ShardError, match="restarted from its checkpoint at version 7"):
            client.pull()  # restored shards wait for the job to agree on a version
        assert client.recover() == 7  # all hold 7: every shard rolls back to it (epoch 1); worker 0 goes on at 7
        after = client.pull()
        stats_after = client.stats()
    for n in before:
        assert torch.equal(after[n], before[n]), n
        assert torch.equal(after[n], weights[n]), n
    for a, b in zip(stats_before, stats_after):
        for key in ("version", "sync", "worker_clocks", "registered_workers", "gradients_applied_total"):
            assert b["epoch"] == 1
            assert a[key] == b[key], key
    # The exactly-once bookkeeping came back too: training continues from step 7 on both shards.
    _train(again.addresses, 3, start=7)
    with shardps.connect(again.addresses) as client:
        assert [s["version"] for s in client.stats()] == [10, 10]


def test_ctl_checkpoint_without_a_directory_is_a_clear_error(cluster2):
    with shardps.connect(cluster2.addresses) as client:
        client.register({"w": torch.zeros(3)}, shardps.optim.SGD(), sync="bsp")
    proc = subprocess.run([sys.executable, "-m", "shardps", "ctl", "--addresses", ",".join(cluster2.addresses),
                           "checkpoint"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "FAILED_PRECONDITION" in proc.stderr and "--checkpoint-dir" in proc.stderr


@pytest.mark.fault
def test_sigterm_ends_waiting_rpcs_with_unavailable_checkpoints_and_exits_0(make_cluster, tmp_path):
    cluster = make_cluster(1, processes=True, checkpoint_dir=str(tmp_path))
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2, recovery_timeout=0) as client:
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(), sync="bsp")
        client.push({"w": torch.ones(8)}, step=0)  # worker 1 never comes: the round stays open
        errors = []

        def wait_for_round():
            try:
                client.pull(min_versions=1)
            except shardps.ShardError as e:
                errors.append(e)

        t = threading.Thread(target=wait_for_round)
        t.start()
        with shardps.connect(cluster.addresses, recovery_timeout=0) as watch:
            deadline = time.monotonic() + 30
            while watch.stats()[0]["waiting_pulls"] == 0:  # until the Pull is parked in the barrier wait
                assert time.monotonic() < deadline
                time.sleep(0.02)  # polling another process
        proc = cluster._procs[0]
        proc.terminate()
        t.join(timeout=30)
        assert not t.is_alive()
    assert proc.wait(timeout=30) == 0
    assert errors and errors[0].code == grpc.StatusCode.UNAVAILABLE, errors
    c = ck.latest(tmp_path, 0)
    assert c is not None and c.meta["pending"]["contributions"][0][:2] == [0, 0]  # the held gradient is kept
