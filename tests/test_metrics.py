"""Prometheus metrics of servers and workers, read from fresh registries."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import shardps
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.metrics import STALENESS_BUCKETS, ServerMetrics, staleness_buckets
from shardps.server.store import ShardStore
from shardps.testing.frames import FrameStub
from shardps.worker.metrics import WorkerMetrics
from tests.helpers import run_workers


def test_staleness_buckets_are_cumulative():
    buckets, total = staleness_buckets({0: 5, 1: 2, 4: 1, 60: 1})
    as_dict = dict(buckets)
    assert [float(b) for b, _ in buckets[:-1]] == [float(b) for b in STALENESS_BUCKETS]
    assert as_dict["0.0"] == 5 and as_dict["1.0"] == 7 and as_dict["3.0"] == 7 and as_dict["5.0"] == 8
    assert as_dict["55.0"] == 8 and as_dict["+Inf"] == 9 and total == 2 + 4 + 60


def _train(addresses, k, workers, sync, steps, registry=None, joined=None):
    """``joined``: a barrier every worker meets once it registered and pulled, before its first push (a worker
    that joins after another's push pulls from that version: one more Pull that waited for a version)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    metrics = WorkerMetrics(registry, k) if registry is not None else None
    with shardps.connect(addresses, worker_id=k, num_workers=workers, part_bytes=64) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.01), sync=sync,
                                           metrics=metrics)
        if joined is not None:
            joined.wait(timeout=60)
        for step in range(steps):
            g = torch.Generator().manual_seed(step * 10 + k)
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            opt.record_loss(loss.item())
        return opt.pushes, loss.item()


def test_server_metrics_after_asp_training(make_cluster):
    cluster = make_cluster(2, metrics=True)
    steps, workers = 6, 2
    worker_regs = [CollectorRegistry() for _ in range(workers)]
    joined = threading.Barrier(workers)  # both join at version 0: only the steps' Pulls wait for a version
    results = run_workers(lambda k: _train(cluster.addresses, k, workers, "asp", steps, worker_regs[k], joined),
                          workers)
    for shard, reg in enumerate(cluster.registries):
        lab = {"shard": str(shard)}
        v = reg.get_sample_value
        assert v("shardps_pushes_total", lab) == workers * steps
        assert v("shardps_gradient_staleness_steps_count", lab) == workers * steps
        assert v("shardps_gradient_staleness_steps_bucket", {**lab, "le": "+Inf"}) == workers * steps
        assert v("shardps_gradient_staleness_steps_bucket", {**lab, "le": "0.0"}) <= workers * steps
        assert v("shardps_shard_version", lab) == workers * steps  # asp: one version per gradient
        assert v("shardps_applied_updates_total", lab) == workers * steps
        assert v("shardps_apply_seconds_count", lab) == workers * steps
        for w in range(workers):
            assert v("shardps_worker_clock_steps", {**lab, "worker": str(w)}) == steps
        assert v("shardps_clock_gap_steps", lab) == 0
        # Both workers finished and said goodbye: none is live, none was evicted (no alert at the end of a job).
        assert v("shardps_live_workers", lab) == 0
        assert v("shardps_worker_leaves_total", lab) == workers and v("shardps_evictions_total", lab) == 0
        assert v("shardps_sync_mode", {**lab, "sync": "asp"}) == 1
        assert v("shardps_tensors", lab) >= 1
        store = cluster.stores[shard]
        assert v("shardps_weight_bytes", lab) == sum(t.weight_bytes for t in store.stats().tensors)
        parts = sum(len(t.spec.parts) for t in store.stats().tensors)
        assert v("shardps_optimizer_state_bytes", lab) == 4 * parts  # SGD without momentum: a step count per part
        assert v("shardps_push_bytes_total", lab) > 0 and v("shardps_pull_bytes_total", lab) > 0
        assert v("shardps_pulls_total", lab) >= workers * steps
        assert v("shardps_skipped_steps_total", lab) == 0
        assert v("shardps_sync_wait_seconds_count", {**lab, "sync": "asp"}) == workers * steps
    for k, reg in enumerate(worker_regs):
        lab = {"worker": str(k)}
        assert reg.get_sample_value("shardps_worker_steps_total", lab) == steps
        assert reg.get_sample_value("shardps_worker_loss", lab) == pytest.approx(results[k][1])
        assert reg.get_sample_value("shardps_worker_push_seconds_count", lab) == steps
        assert reg.get_sample_value("shardps_worker_pull_seconds_count", lab) == steps
        assert reg.get_sample_value("shardps_worker_step_seconds_count", lab) == steps - 1
        assert reg.get_sample_value("shardps_worker_clock_steps_pushed", lab) == steps


def test_rpc_errors_are_counted_by_code(make_cluster):
    cluster = make_cluster(1, metrics=True)
    with shardps.connect(cluster.addresses) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(), sync="bsp")
    with FrameStub(cluster.addresses[0]) as stub:  # Pull as a data connection's frame
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                stub.Pull(ps_pb2.PullRequest(names=["ghost"]), timeout=5)
    v = cluster.registries[0].get_sample_value
    assert v("shardps_rpc_errors_total", {"shard": "0", "method": "Pull", "code": "NOT_FOUND"}) == 2


def test_bsp_wait_is_observed_and_clock_gap_is_read_at_scrape_time():
    store = ShardStore(0, 1, sync="bsp", num_workers=2)
    reg = CollectorRegistry()
    ServerMetrics(store, reg)
    store.leases.register(0)
    store.leases.register(1)
    store.job.worker_clocks.update({0: 7, 1: 3})  # as the store keeps them: last step pushed
    assert reg.get_sample_value("shardps_clock_gap_steps", {"shard": "0"}) == 4
    assert reg.get_sample_value("shardps_worker_clock_steps", {"shard": "0", "worker": "0"}) == 8


def test_metrics_endpoint_serves_text_format(make_cluster):
    cluster = make_cluster(1, metrics=True)
    body = urllib.request.urlopen(f"http://{cluster.metrics_addresses[0]}/metrics", timeout=10).read().decode()
    assert "# TYPE shardps_gradient_staleness_steps histogram" in body
    assert 'shardps_clock_gap_steps{shard="0"}' in body


def test_process_server_reports_its_metrics_address(make_cluster):
    cluster = make_cluster(1, processes=True, metrics=True)
    assert len(cluster.metrics_addresses) == 1
    body = urllib.request.urlopen(f"http://{cluster.metrics_addresses[0]}/metrics", timeout=10).read().decode()
    assert "shardps_shard_version" in body
