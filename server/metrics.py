"""Prometheus metrics of one shard.

What is cheap to read (counters the store keeps, versions, clocks, bytes,
the staleness histogram built from the store's exact counts) is collected
at scrape time by ``StoreCollector``; what must be observed as it happens
(apply time, barrier/SSP wait time, RPC errors) is recorded by
``ServerMetrics``. Everything is created on the registry passed in; every
sample carries the label ``shard``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shardps.server.store import ShardStore

#: Staleness is counted in versions (steps); Fibonacci buckets.
STALENESS_BUCKETS = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def staleness_buckets(counts: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and the sum, from exact {staleness: count}."""
    out = []
    for b in STALENESS_BUCKETS:
        out.append((str(float(b)), float(sum(n for s, n in counts.items() if s <= b))))
    out.append(("+Inf", float(sum(counts.values()))))
    return out, float(sum(s * n for s, n in counts.items()))


class StoreCollector(Collector):
    """Reads the store at scrape time."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        st = self.store.stats()
        clocks = self.store.clocks()
        shard = str(st["shard_index"])
        lab = ["shard"]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=lab)
            m.add_metric([shard], value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(name, doc, labels=lab)
            m.add_metric([shard], value)
            return m

        h = HistogramMetricFamily(
            "shardps_gradient_staleness_steps",
            "Staleness of each gradient taken in: shard version at apply minus the version it was computed from.",
            labels=lab)
        buckets, total = staleness_buckets(st["staleness_counts"])
        h.add_metric([shard], buckets, total)
        yield h
        wc = GaugeMetricFamily("shardps_worker_clock_steps", "Steps each worker has pushed to this shard.",
                               labels=["shard", "worker"])
        for w, c in sorted(clocks.items()):
            wc.add_metric([shard, str(w)], c)
        yield wc
        gap = (max(clocks.values()) - min(clocks.values())) if clocks else 0
        yield gauge("shardps_clock_gap_steps", "Fastest minus slowest worker clock on this shard.", gap)
        yield counter("shardps_pushes_total", "Push RPCs taken in (duplicates included).", st["pushes_total"])
        yield counter("shardps_duplicate_pushes_total", "Retried pushes acknowledged without applying.",
                      st["duplicate_pushes_total"])
        yield counter("shardps_push_bytes_total", "Gradient payload bytes taken in.", st["push_bytes_total"])
        yield counter("shardps_pulls_total", "Pull RPCs served.", st["pulls_total"])
        yield counter("shardps_pull_bytes_total", "Weight payload bytes served.", st["pull_bytes_total"])
        yield counter("shardps_applied_updates_total", "Optimizer steps applied.", st["applied_updates_total"])
        yield counter("shardps_gradients_applied_total", "Worker gradients folded into applied steps.",
                      st["gradients_applied_total"])
        yield counter("shardps_skipped_steps_total", "Steps skipped because a gradient held inf/nan.",
                      st["skipped_steps_total"])
        yield counter("shardps_sync_switches_total", "Sync mode switches of the running job.",
                      st["sync_switches_total"])
        yield gauge("shardps_shard_version", "Optimizer steps this shard has completed (skipped included).",
                    st["version"])
        yield gauge("shardps_tensors", "Tensors (with at least one part) held by this shard.", len(st["tensors"]))
        yield gauge("shardps_weight_bytes", "Bytes of fp32 master weights held.",
                    sum(t["weight_bytes"] for t in st["tensors"]))
        yield gauge("shardps_optimizer_state_bytes", "Bytes of optimizer state held.",
                    sum(t["optimizer_state_bytes"] for t in st["tensors"]))
        yield gauge("shardps_live_workers", "Workers registered and live on this shard.",
                    len(st["registered_workers"]))
        yield gauge("shardps_waiting_pulls", "Pulls parked in a barrier, SSP or version wait right now.",
                    st["waiting_pulls"])
        yield counter("shardps_evictions_total", "Workers evicted because their lease expired.",
                      st["evictions_total"])
        yield gauge("shardps_loss_scale", "Current dynamic loss scale (0: loss scaling off).", st["loss_scale"])
        mode = GaugeMetricFamily("shardps_sync_mode", "The job's sync mode (1 for the mode in force).",
                                 labels=["shard", "sync"])
        mode.add_metric([shard, st["sync"] or "none"], 1)
        yield mode


class ServerMetrics:
    """A shard's metrics on ``registry``: the store collector plus event metrics."""

    def __init__(self, store: ShardStore, registry: CollectorRegistry) -> None:
        self.shard = str(store.shard_index)
        registry.register(StoreCollector(store))
        self.apply_seconds = Histogram(
            "shardps_apply_seconds", "Time to apply one optimizer step to all parts held.",
            ["shard"], registry=registry, buckets=SECONDS_BUCKETS)
        self.wait_seconds = Histogram(
            "shardps_sync_wait_seconds", "Time a Pull waited for a barrier (bsp/every:X) or SSP clocks.",
            ["shard", "sync"], registry=registry, buckets=SECONDS_BUCKETS)
        self.rpc_errors = Counter(
            "shardps_rpc_errors_total", "RPCs answered with an error status.",
            ["shard", "method", "code"], registry=registry)
        store.on_apply.append(self.apply_seconds.labels(self.shard).observe)

    def observe_wait(self, seconds: float, sync: str) -> None:
        self.wait_seconds.labels(self.shard, sync).observe(seconds)

    def rpc_error(self, method: str, code: str) -> None:
        self.rpc_errors.labels(self.shard, method, code).inc()
