"""Worker leases: a dead worker is evicted, barriers complete with the live ones, nobody hangs."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time

import pytest
import torch

import shardps
from shardps.server.store import ShardStore, TensorSpec
from tests.helpers import shardps_process


def _store(workers=3, sync="bsp", lease=5.0):
    st = ShardStore(0, 1, lease_s=lease)
    st.path.configure(workers, sync)
    st.path.register_tensors([TensorSpec("w", (2,), 1, shardps.optim.SGD(lr=1.0), ((0, 2),))], {("w",
                                                                                                 0): torch.zeros(2)})
    for w in range(workers):
        st.leases.register(w)
    return st


def test_eviction_completes_the_round_with_the_live_workers(caplog):
    caplog.set_level(logging.WARNING, logger="shardps.server")
    st = _store()
    st.path.submit(0, 0, 0, {("w", 0): torch.tensor([1.0, 1.0])})
    st.path.submit(1, 0, 0, {("w", 0): torch.tensor([3.0, 3.0])})
    assert st.job.version == 0  # waiting for worker 2
    now = time.monotonic()
    st.leases.touch(0)
    st.leases.touch(1)
    assert st.leases.evict_expired(now + 4.0) == []
    st.leases.membership.last_seen[2] = now - 10  # worker 2 went silent
    assert st.leases.evict_expired(now) == [2]
    assert st.job.version == 1  # the round completed with workers 0 and 1: their mean
    assert torch.equal(st.reader.weights("w")[0], torch.tensor([-2.0, -2.0]))
    assert st.leases.evictions_total == 1 and st.stats().evicted_workers == [2]
    assert "evicted worker 2" in caplog.text
    # The next rounds need only the live workers; the evicted one must register again.
    st.path.submit(0, 1, 1, {("w", 0): torch.tensor([1.0, 1.0])})
    st.path.submit(1, 1, 1, {("w", 0): torch.tensor([1.0, 1.0])})
    assert st.job.version == 2
    with pytest.raises(shardps.server.errors.FailedPrecondition, match="worker 2 was evicted"):
        st.path.submit(2, 0, 0, {("w", 0): torch.tensor([1.0, 1.0])})
    st.leases.register(2)  # rejoins; from now on rounds wait for it again
    st.path.submit(0, 2, 2, {("w", 0): torch.tensor([1.0, 1.0])})
    st.path.submit(1, 2, 2, {("w", 0): torch.tensor([1.0, 1.0])})
    assert st.job.version == 2
    st.path.submit(2, 0, 2, {("w", 0): torch.tensor([1.0, 1.0])})
    assert st.job.version == 3


def test_evicted_workers_do_not_hold_ssp_back():
    st = _store(workers=2, sync="ssp:1")
    for step in range(3):
        st.path.submit(0, step, st.job.version, {("w", 0): torch.ones(2)})
    with pytest.raises(shardps.server.errors.DeadlineExceeded, match="behind: {1: 0}"):
        st.job.wait_clock(3, timeout=0.05)
    st.leases.membership.last_seen[1] = time.monotonic() - 60
    st.leases.evict_expired()
    assert st.job.wait_clock(3, timeout=0.05) == 3


def _clocks(cluster) -> dict[int, int]:
    return cluster.stores[0].clocks()


@pytest.mark.fault
@pytest.mark.timeout(240)
def test_kill_9_one_of_3_workers_under_bsp_the_others_finish(make_cluster, caplog):
    caplog.set_level(logging.WARNING, logger="shardps.server")
    cluster = make_cluster(2, lease_s=4.0)  # survivors heartbeat every 1.3 s: room for a loaded machine
    procs = []
    for k in range(3):
        procs.append(shardps_process("worker", "--example", "digits", "--addresses", ",".join(cluster.addresses),
                                     "--worker-id", str(k), "--num-workers", "3", "--sync", "bsp", "--epochs", "3",
                                     "--batch-size", "48", stderr=subprocess.PIPE))
    try:
        deadline = time.monotonic() + 120
        while _clocks(cluster).get(2, 0) < 5:  # let worker 2 take part for a few steps
            assert time.monotonic() < deadline, "workers never got going"
            assert all(p.poll() is None for p in procs), "a worker exited early"
            time.sleep(0.05)  # polling another process's progress
        os.kill(procs[2].pid, signal.SIGKILL)
        outs = [p.communicate(timeout=120) for p in procs[:2]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
    for p, (out, err) in zip(procs[:2], outs):
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1])["steps"] == 3 * (1437 // 48)
    for store in cluster.stores:
        st = store.stats()
        assert st.evictions_total == 1 and st.evicted_workers == [2]
    assert "evicted worker 2" in caplog.text
