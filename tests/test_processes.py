"""Servers as separate processes: ready line, shard identity checks, clean exit on SIGTERM."""

import signal
import subprocess
import sys

import pytest
import torch

import shardps
from shardps.deploy.local import parse_ready, read_ready, read_ready_lines

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
    cluster.stop(grace=120.0)  # SIGKILL only past a grace no loaded machine reaches
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


@pytest.mark.fault
def test_one_server_process_serves_several_shards_and_a_worker_trains_on_them():
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "server", "--port", "0", "--shards", "3",
                             "--num-shards", "3"], stdout=subprocess.PIPE, text=True)
    try:
        addresses = [parse_ready(line)[0] for line in read_ready_lines(proc, 60, 3)]
        assert len(set(addresses)) == 3
        with shardps.connect(addresses, worker_id=0, num_workers=1, part_bytes=4096) as client:
            w = torch.arange(4096, dtype=torch.float32)
            client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
            assert {p.server for p in client.shard_map.parts} == {0, 1, 2}
            client.push({"w": torch.ones(4096)}, step=0)
            assert torch.equal(client.pull(min_versions=1)["w"], w - 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


@pytest.mark.parametrize("argv, message", [
    (["--shards", "0"], "--shards must be >= 1"),
    (["--shards", "3", "--num-shards", "2"], "do not exist"),
    (["--shards", "2", "--num-shards", "2", "--replicas", "2"], "serves primaries only"),
])
def test_server_shards_refused(argv, message):
    out = subprocess.run([sys.executable, "-m", "shardps", "server", "--port", "0", *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
