"""A finished script exits 0, every time.

Found by a new user: a script that ran five in-process LocalClusters one after
another, each with a client and a DistributedOptimizer, all closed, sometimes
died at interpreter exit ("terminate called without an active exception",
SIGABRT, exit 134). gRPC's ``Server.stop`` only starts the shutdown; the
process could reach exit while a server's polling thread was still inside
the C core. ``LocalCluster.stop`` now waits until each server has ended and
joins the threads it started (``stop_server``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardps.deploy.local import LocalCluster

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast

SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    import shardps

    for i in range(5):
        with shardps.LocalCluster(num_servers=2) as cluster:
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp")
            for step in range(3):
                model(torch.randn(4, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            client.close()
            with shardps.connect(cluster.addresses) as reader:  # a last RPC right before the end
                reader.stats()
    print("done")
""")
RUNS = 6


@pytest.mark.fault
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_scripts_with_in_process_clusters_exit_0_every_time(tmp_path):
    script = tmp_path / "five_clusters.py"
    script.write_text(SCRIPT)

    def run(_: int) -> tuple[int, str]:
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout + p.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(RUNS)))
    codes = [code for code, _ in results]
    bad = [out for code, out in results if code != 0 or "terminate called" in out]
    assert codes == [0] * RUNS and bad == [], (codes, bad[:1])
    assert all(out.startswith("done") for _, out in results)


@pytest.mark.cluster
def test_stop_leaves_no_thread_of_the_cluster_running():
    before = set(threading.enumerate())
    cluster = LocalCluster(2, lease_s=5.0).start()
    cluster.stop()
    assert [t.name for t in set(threading.enumerate()) - before] == []
