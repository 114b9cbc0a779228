"""`shardps stats` and `shardps ctl` against a running cluster."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

import shardps
from shardps.admin import percentile, render_table, run_stats, stats_rows


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardps", *args], capture_output=True, text=True, timeout=120)


def test_percentiles_from_exact_counts():
    counts = {0: 50, 1: 30, 2: 15, 7: 5}
    assert percentile(counts, 0.5) == 0 and percentile(counts, 0.51) == 1
    assert percentile(counts, 0.95) == 2 and percentile(counts, 0.99) == 7
    assert percentile({}, 0.5) is None


def _job(cluster):
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=2)
    client.register({"w": torch.zeros(256, 64), "b": torch.zeros(64)}, shardps.optim.Adam(), sync="asp")
    for step in range(3):
        client.push({"w": torch.ones(256, 64), "b": torch.ones(64)}, step=step)
    return client


def test_stats_table_once_and_watching(cluster2):
    client = _job(cluster2)
    proc = _cli("stats", "--addresses", ",".join(cluster2.addresses))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["shard", "version", "sync"] and len(lines) == 4
    rows = stats_rows(client.stats())
    assert [r[:3] for r in rows] == [["0", "3", "asp"], ["1", "3", "asp"]]
    assert all(r[8] == "3" and r[9] == "1/2" for r in rows)  # clock gap 3 (worker 1 at 0), 1 of 2 workers live
    # staleness: base version 0 for every push, applied at versions 0, 1, 2 -> p50 1, p99 2
    assert all((r[6], r[7]) == ("1", "2") for r in rows)
    out = io.StringIO()
    assert run_stats(cluster2.addresses, watch=0.01, iterations=2, out=out) == 0
    assert out.getvalue().count("shardps stats") == 2
    assert render_table(rows) in out.getvalue()
    client.close()


def test_ctl_set_sync_switches_every_shard(cluster2):
    client = _job(cluster2)
    proc = _cli("ctl", "--addresses", ",".join(cluster2.addresses), "set-sync", "ssp:2")
    assert proc.returncode == 0, proc.stderr
    assert "sync is now ssp:2 on 2 shards" in proc.stdout
    assert [str(s.job.sync) for s in cluster2.stores] == ["ssp:2", "ssp:2"]
    bad = _cli("ctl", "--addresses", ",".join(cluster2.addresses), "set-sync", "sometimes")
    assert bad.returncode == 2 and "unknown sync mode" in bad.stderr
    client.close()


def test_stats_on_a_dead_address_is_a_clear_error():
    proc = _cli("stats", "--addresses", "127.0.0.1:1", "--timeout", "1")
    assert proc.returncode == 1
    assert "127.0.0.1:1" in proc.stderr and "Traceback" not in proc.stderr


def test_choices_come_from_the_registries():
    import argparse

    from shardps.cli import build_parser
    from shardps.protos.optim import SPECS
    from shardps.worker.pipeline.offload import ENCODINGS
    from shardps.worker.pipeline.schedule import SCHEDULES
    from shardps.worker.pipeline.stage import CHECKPOINT_MODES

    [subs] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]

    def choices(command: str, flag: str) -> list[str]:
        [action] = [a for a in subs.choices[command]._actions if flag in a.option_strings]
        return list(action.choices)

    for command in ("worker", "demo", "ray"):
        assert choices(command, "--optimizer") == list(SPECS), command
    assert choices("ray", "--schedule") == list(SCHEDULES)
    assert choices("ray", "--recompute") == list(CHECKPOINT_MODES)
    assert choices("ray", "--compress") == list(ENCODINGS)


def test_push_window_reaches_the_workers_of_the_demo_and_the_simulated_cluster(capsys):
    from shardps.cli import build_parser
    from shardps.deploy.demo import _worker_args

    parser = build_parser()
    for command in ("demo", "sim"):
        args = parser.parse_args([command, "--push-window", "2"])
        cmd = _worker_args(["a:1", "b:2", "c:3"], 0, args)
        assert cmd[cmd.index("--push-window") + 1] == "2", command
        assert parser.parse_args(cmd[cmd.index("worker"):]).push_window == 2
        assert "--push-window" not in _worker_args(["a:1"], 0, parser.parse_args([command]))
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--push-window", "0"])
        assert "expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_server_frame_inline_bytes_from_flag_or_env_and_a_bad_one_refused():
    from shardps.server.app import ShardServer

    proc = _cli("server", "--frame-inline-bytes", "-1")
    assert proc.returncode == 2
    assert "--frame-inline-bytes / SHARDPS_FRAME_INLINE_BYTES must be >= 0, got -1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "shardps", "server"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SHARDPS_FRAME_INLINE_BYTES": "lots"})
    assert proc.returncode != 0 and "SHARDPS_FRAME_INLINE_BYTES='lots' is not an integer" in proc.stderr
    server = ShardServer(frame_inline_bytes=0, replicas=1).start()
    try:
        assert server.store is not None and server.store.reader.frame_inline_bytes == 0
    finally:
        server.stop()
    with pytest.raises(ValueError, match="frame_inline_bytes must be an integer >= 0, got -5"):
        ShardServer(frame_inline_bytes=-5)


def test_server_replica_timeout_reaches_the_primary_and_the_backup_and_a_bad_one_is_refused():
    from shardps.server.app import ShardServer

    proc = _cli("server", "--replica-timeout", "0")
    assert proc.returncode == 2 and "--replica-timeout must be > 0, got 0.0" in proc.stderr
    server = ShardServer(num_shards=2, replicas=2, replica_timeout_s=2.5).start()
    try:
        assert server.store is not None and server.backup is not None
        assert server.store.replica.replica_timeout_s == 2.5 and server.backup.replica.replica_timeout_s == 2.5
    finally:
        server.stop()
    assert ShardServer().replica_timeout_s == 30.0
    with pytest.raises(ValueError, match="the replica timeout must be a number of seconds > 0, got -1"):
        ShardServer(replica_timeout_s=-1)


def test_the_parser_and_the_servers_checks_import_no_torch_so_refusals_answer_at_once():
    code = ("import sys; from shardps.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "shardps", "worker", "--compress", "topk:2"], capture_output=True,
                       text=True, timeout=60)  # a spec that is checked imports what checks it
    assert p.returncode == 2 and "--compress" in p.stderr, p.stderr
    code = ("import sys; from shardps.cli import main; rc = main(['server', '--replicas', '2', '--num-shards', "
            "'1']); print(rc, 'torch' in sys.modules)")  # a server's refused setting: before the server's import
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "2 False" and "needs at least 2 servers" in p.stderr, p.stdout + p.stderr


def test_health_is_light_enough_for_a_healthcheck_every_few_seconds(cluster2):
    """`shardps health` runs in every server's container every 10 s (deploy/docker-compose.yml): it imports
    neither torch nor the rest of the CLI, and still answers SERVING, or names why not."""
    code = ("import sys; from shardps.cli import main; rc = main(['health', '--address', sys.argv[1], '--timeout', "
            "'5']); print(rc, sorted(m for m in ('torch', 'numpy', 'shardps.worker.client') if m in sys.modules))")
    for address, expected in ((cluster2.addresses[0], "0 []"), ("127.0.0.1:1", "1 []")):
        p = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60)
        assert p.stdout.strip().splitlines()[-1] == expected, p.stdout + p.stderr
        assert ("SERVING" if expected == "0 []" else "connection refused") in p.stdout
