"""A real Prometheus scrapes a running local cluster; every shipped dashboard query evaluates.

Uses Debian's prometheus binary, which `make test` installs (apt, as root).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import shardps
from shardps.exposition import serve_metrics
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.frames import FrameStub
from shardps.worker.metrics import WorkerMetrics
from tests.helpers import chosen_port, run_workers, start_prometheus, stop_prometheus

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus is not installed (`make test` installs it with apt as root)")]
ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))


def _free_port() -> int:
    return chosen_port()  # below the ephemeral range: nothing else takes it before its process binds it


def _train(addresses, k, steps):
    torch.manual_seed(0)
    model = nn.Linear(32, 8)
    registry = CollectorRegistry()
    endpoint = serve_metrics(registry, "127.0.0.1", 0)
    with shardps.connect(addresses, worker_id=k, num_workers=2, part_bytes=256) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(), sync="asp",
                                           metrics=WorkerMetrics(registry, k))
        for step in range(steps):
            g = torch.Generator().manual_seed(step * 10 + k)
            loss = model(torch.randn(8, 32, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            opt.record_loss(loss.item())
    return endpoint


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A trained 2-shard cluster with 2 worker endpoints, scraped by a real Prometheus."""
    tmp = tmp_path_factory.mktemp("prom")
    cluster = shardps.LocalCluster(2, metrics=True, replicas=2).start()
    endpoints = []
    proc = None
    try:
        endpoints = run_workers(lambda k: _train(cluster.addresses, k, 40), 2)
        with FrameStub(cluster.addresses[0]) as stub:  # one refused request: shardps_rpc_errors_total
            with pytest.raises(grpc.RpcError):
                stub.Pull(ps_pb2.PullRequest(names=["ghost"]), timeout=5)
        targets = cluster.metrics_addresses + [e.address for e in endpoints]
        (tmp / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: shardps\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        proc, prom = start_prometheus(PROMETHEUS, tmp)
        # Every target up, scraped at least twice (so rate() has two points).
        prom.wait_for('count(up == 1) == 4')
        prom.wait_for('count(count_over_time(shardps_shard_version[1m]) >= 2) == 2')
        yield prom
    finally:
        if proc is not None:
            stop_prometheus(proc)
        for e in endpoints:
            e.close()
        cluster.stop()


def test_staleness_and_clock_gap_are_scraped(scraped):
    counts = scraped.wait_for("shardps_gradient_staleness_steps_count")
    assert sorted(r["metric"]["shard"] for r in counts) == ["0", "1"]
    assert all(float(r["value"][1]) == 80 for r in counts)  # 2 workers x 40 steps, on each shard
    buckets = scraped.wait_for("shardps_gradient_staleness_steps_bucket")
    assert {r["metric"]["le"] for r in buckets} >= {"0.0", "1.0", "2.0", "3.0", "5.0", "8.0", "55.0", "+Inf"}
    gap = scraped.wait_for("shardps_clock_gap_steps")
    assert len(gap) == 2
    q = scraped.wait_for("histogram_quantile(0.99, sum by (le) (shardps_gradient_staleness_steps_bucket))")
    assert math.isfinite(float(q[0]["value"][1]))
    assert scraped.wait_for("shardps_worker_loss")


def _dashboard_exprs() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                out.append((path.name, panel["title"], t["expr"]))
    return out


def _concrete(expr: str) -> str:
    """Grafana's variables replaced as Grafana would for 'All' over a short range."""
    return expr.replace("$__rate_interval", "1m").replace('=~"$shard"', '=~".*"')


def test_dashboards_ship_the_panels_the_issue_lists():
    titles = " ".join(title.lower() for _, title, _ in _dashboard_exprs())
    for words in ("staleness p50", "staleness p99", "clock gap", "push / pull rate", "bytes per second",
                  "barrier", "apply time", "loss", "live workers"):
        assert words in titles, words


@pytest.mark.parametrize("name, title, expr", _dashboard_exprs(), ids=lambda v: v if len(v) < 40 else None)
def test_every_dashboard_expression_evaluates(scraped, name, title, expr):
    assert "$" not in _concrete(expr), f"unhandled variable in {expr!r}"
    res = scraped.query(_concrete(expr))
    assert res["status"] == "success", (name, title, res)
    # Every metric it names exists in what Prometheus scraped (catches misspelt names).
    for metric in set(re.findall(r"shardps_[a-z0-9_]+", expr)):
        assert scraped.query(f"count({metric})")["data"]["result"], f"{title}: no series {metric}"
