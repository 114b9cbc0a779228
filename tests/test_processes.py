"""Servers as separate processes: ready line, shard identity checks, clean exit on SIGTERM."""

import signal
import subprocess
import sys

import pytest
import torch

import shardps
from shardps.deploy.local import parse_ready, read_ready

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast


def test_process_cluster_trains_and_stops(make_cluster):
    cluster = make_cluster(2, processes=True)
    procs = list(cluster._procs)
    with shardps.connect(cluster.addresses) as client:
        client.register({"w": torch.ones(1000, 10)}, shardps.optim.SGD(lr=0.5), sync="bsp")
        client.push({"w": torch.ones(1000, 10)}, step=0)
        w = client.pull(min_versions=1)["w"]
        assert torch.equal(w, torch.full((1000, 10), 0.5))
        assert [s["shard_index"] for s in client.stats()] == [0, 1]
    cluster.stop()
    assert [p.returncode for p in procs] == [0, 0]  # SIGTERM: graceful stop, exit 0


def test_addresses_out_of_shard_order_are_refused(make_cluster):
    cluster = make_cluster(2)
    with shardps.connect(list(reversed(cluster.addresses))) as client:
        with pytest.raises(ValueError, match="is shard 1 of 2, but was given as shard 0 of 2"):
            client.register({"w": torch.ones(4)}, shardps.optim.SGD(), sync="asp")


@pytest.mark.fault
def test_server_cli_sigterm_exits_zero():
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "server", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        address, _ = parse_ready(read_ready(proc, 60))
        assert address.startswith("127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
