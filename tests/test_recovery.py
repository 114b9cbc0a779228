"""kill -9 a server mid-training, restart it: the job rolls back to a common checkpoint and finishes
with the same weights as a run without the fault."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

import shardps
from shardps.deploy.local import read_ready
from tests.helpers import run_workers

STEPS, WORKERS, EVERY = 20, 2, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(port: int, shard: int, ckpt) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shardps", "server", "--port", str(port), "--shard-index", str(shard),
           "--num-shards", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY),
           "--lease-seconds", "60"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    read_ready(proc, 60)
    return proc


def _train(addresses, rollbacks):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))

    def worker(k):
        model = copy.deepcopy(base)  # not torch.manual_seed in threads: the global generator is shared
        with shardps.connect(addresses, worker_id=k, num_workers=WORKERS, part_bytes=512,
                             recovery_timeout=120) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp")
            step = 0
            while step < STEPS:
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


@pytest.mark.timeout(300)
def test_kill_9_a_server_restart_it_and_the_run_finishes_exactly(tmp_path):
    ports = [_free_port(), _free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = [_server(ports[i], i, tmp_path / "faulty") for i in range(2)]
    clean = [_server(p, i, tmp_path / "clean") for i, p in enumerate((_free_port(), _free_port()))]
    try:
        clean_addresses = [f"127.0.0.1:{p.args[p.args.index('--port') + 1]}" for p in clean]
        expected = _train(clean_addresses, [])

        killed = threading.Event()

        def killer():
            with shardps.connect(addresses[:1], recovery_timeout=0) as watch:
                deadline = time.monotonic() + 120
                while True:
                    try:
                        if watch.stats()[0]["version"] >= 12:
                            break
                    except shardps.ShardError:
                        pass
                    assert time.monotonic() < deadline
                    time.sleep(0.01)  # polling another process's version
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(timeout=30)
            procs[1].stdout.close()
            procs[1] = _server(ports[1], 1, tmp_path / "faulty")  # same address, restores version 10
            killed.set()

        t = threading.Thread(target=killer)
        t.start()
        rollbacks: list[tuple[int, int, int]] = []
        got = _train(addresses, rollbacks)
        t.join(timeout=60)
        assert killed.is_set()
        assert rollbacks and all(to == 10 for _, _, to in rollbacks), rollbacks
        for (k, exp), res in zip(enumerate(expected), got):
            for n in exp:
                assert torch.equal(res[n], exp[n]), (k, n)
        with shardps.connect(addresses) as c:
            stats = c.stats()
        assert [s["epoch"] for s in stats] == [1, 1] and [s["version"] for s in stats] == [STEPS, STEPS]
    finally:
        for p in procs + clean:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            if p.stdout and not p.stdout.closed:
                p.stdout.close()
