"""Prometheus metrics of one shard.

What is cheap to read (counters the store keeps, versions, clocks, bytes,
the staleness histogram built from the store's exact counts) is collected
at scrape time by ``StoreCollector``; what must be observed as it happens
(apply time, barrier/SSP wait time, RPC errors) is recorded by
``ServerMetrics``. Row tables' metrics: server/rows/metrics.py. Everything is created on the registry passed in; every
sample carries the label ``shard``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shardps.protos.stats import ShardStats
from shardps.server.replication.roles import Role
from shardps.server.rows.metrics import row_families
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
    """Reads the stores at scrape time: the server's own shard, and a backup it holds once that took over."""

    def __init__(self, store: ShardStore, backups: Sequence[ShardStore] = ()) -> None:
        self.store = store
        self.backups = list(backups)

    def collect(self) -> Iterator[Metric]:
        serving = [st for st in [self.store, *self.backups] if st.replica.role == Role.PRIMARY] or [self.store]
        snaps = [(str(st.shard_index), st.stats(), st.clocks()) for st in serving]
        lab = ["shard"]

        def family(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str,
                   value: Callable[[ShardStats, dict[int, int]], float]) -> Metric:
            m = kind(name, doc, labels=lab)
            for shard, st, clocks in snaps:
                m.add_metric([shard], value(st, clocks))
            return m

        def counter(name: str, doc: str, key: str) -> Metric:
            return family(CounterMetricFamily, name, doc, lambda st, _: getattr(st, key))

        def gauge(name: str, doc: str, value: Callable[[ShardStats, dict[int, int]], float]) -> Metric:
            return family(GaugeMetricFamily, name, doc, value)

        h = HistogramMetricFamily(
            "shardps_gradient_staleness_steps",
            "Staleness of each gradient taken in: shard version at apply minus the version it was computed from.",
            labels=lab)
        for shard, st, _ in snaps:
            buckets, total = staleness_buckets(st.staleness_counts)
            h.add_metric([shard], buckets, total)
        yield h
        wc = GaugeMetricFamily("shardps_worker_clock_steps",
                               "Steps each worker has pushed to this shard (live workers, and those that left).",
                               labels=["shard", "worker"])
        for shard, st, clocks in snaps:
            final = {w: st.worker_clocks.get(w, -1) + 1 for w in st.left_workers}
            for w, c in sorted({**final, **clocks}.items()):
                wc.add_metric([shard, str(w)], c)
        yield wc
        yield gauge("shardps_clock_gap_steps", "Fastest minus slowest clock of the live workers on this shard.",
                    lambda _, c: (max(c.values()) - min(c.values())) if c else 0)
        yield counter("shardps_pushes_total", "Push RPCs taken in (duplicates included).", "pushes_total")
        yield counter("shardps_duplicate_pushes_total", "Retried pushes acknowledged without applying.",
                      "duplicate_pushes_total")
        yield counter("shardps_push_bytes_total", "Gradient payload bytes taken in.", "push_bytes_total")
        yield counter("shardps_push_received_bytes_total",
                      "Bytes of Push request messages received (serialized, as gRPC handed them over; refused "
                      "ones included), and the data connections' frames.", "push_received_bytes_total")
        yield counter("shardps_pulls_total", "Pull RPCs served.", "pulls_total")
        yield counter("shardps_pull_bytes_total", "Weight payload bytes served.", "pull_bytes_total")
        yield counter("shardps_applied_updates_total", "Optimizer steps applied.", "applied_updates_total")
        yield counter("shardps_gradients_applied_total", "Worker gradients folded into applied steps.",
                      "gradients_applied_total")
        yield counter("shardps_skipped_steps_total", "Steps skipped because a gradient held inf/nan.",
                      "skipped_steps_total")
        yield counter("shardps_sync_switches_total", "Sync mode switches of the running job.", "sync_switches_total")
        yield gauge("shardps_shard_version", "Optimizer steps this shard has completed (skipped included).",
                    lambda st, _: st.version)
        yield gauge("shardps_tensors", "Tensors (with at least one part) held by this shard.",
                    lambda st, _: len(st.tensors))
        yield gauge("shardps_weight_bytes", "Bytes of fp32 master weights held.",
                    lambda st, _: sum(t.weight_bytes for t in st.tensors))
        yield gauge("shardps_optimizer_state_bytes", "Bytes of optimizer state held.",
                    lambda st, _: sum(t.optimizer_state_bytes for t in st.tensors))
        yield gauge("shardps_live_workers", "Workers registered and live on this shard.",
                    lambda st, _: len(st.registered_workers))
        yield gauge("shardps_waiting_pulls", "Pulls parked in a barrier, SSP or version wait right now.",
                    lambda st, _: st.waiting_pulls)
        yield counter("shardps_evictions_total", "Workers evicted because their lease expired.", "evictions_total")
        yield counter("shardps_worker_leaves_total", "Workers that finished and said goodbye (Leave).",
                      "leaves_total")
        yield gauge("shardps_loss_scale", "Current dynamic loss scale (0: loss scaling off).",
                    lambda st, _: st.loss_scale)
        mode = GaugeMetricFamily("shardps_sync_mode", "The job's sync mode (1 for the mode in force).",
                                 labels=["shard", "sync"])
        for shard, st, _ in snaps:
            mode.add_metric([shard, st.sync or "none"], 1)
        yield mode
        rs = GaugeMetricFamily("shardps_replica_state",
                               "Replication of this shard (--replicas 2): 1 for the state it is in "
                               "(none, resync, syncing, synced, degraded, deposed).", labels=["shard", "state"])
        for shard, st, _ in snaps:
            rs.add_metric([shard, st.replica_state], 1)
        yield rs
        yield counter("shardps_replicated_ops_total", "State changes the shard's backup has confirmed.",
                      "replicated_ops_total")
        yield gauge("shardps_replication_lag_ops", "State changes made but not yet confirmed by the backup.",
                    lambda st, _: st.replication_lag_ops)
        yield counter("shardps_promotions_total", "Times this server's backup of the shard took over serving it.",
                      "promotions_total")
        standby = GaugeMetricFamily("shardps_backup_replayed_ops",
                                    "Backups this server holds and does not serve yet: the last op replayed.",
                                    labels=["shard"])
        for b in self.backups:
            if b.replica.role == Role.BACKUP:
                standby.add_metric([str(b.shard_index)], b.replica.replica_seq)
        yield standby
        rh = HistogramMetricFamily(
            "shardps_row_staleness_steps",
            "Per row pushed to a row table: the steps that updated the row between the worker's pull and its push.",
            labels=lab)
        for store in serving:
            buckets, total = staleness_buckets(store.rows.staleness())
            rh.add_metric([str(store.shard_index)], buckets, total)
        yield rh
        yield from row_families([(str(store.shard_index), store.rows) for store in serving])


class ServerMetrics:
    """A shard's metrics on ``registry``: the store collector plus event metrics."""

    def __init__(self, store: ShardStore, registry: CollectorRegistry, backups: Sequence[ShardStore] = ()) -> None:
        self.shard = str(store.shard_index)
        registry.register(StoreCollector(store, backups))
        self.apply_seconds = Histogram(
            "shardps_apply_seconds", "Time to apply one optimizer step to all parts held.",
            ["shard"], registry=registry, buckets=SECONDS_BUCKETS)
        self.wait_seconds = Histogram(
            "shardps_sync_wait_seconds",
            "Time a Pull waited for the version or clocks it asked for: a barrier (bsp/every:X), SSP clocks, "
            "or under asp the version its own push made.",
            ["shard", "sync"], registry=registry, buckets=SECONDS_BUCKETS)
        self.rpc_errors = Counter(
            "shardps_rpc_errors_total", "RPCs answered with an error status.",
            ["shard", "method", "code"], registry=registry)
        self.replication_seconds = Histogram(
            "shardps_replication_wait_seconds",
            "Time a Push waited for its backup to confirm the change before it was acknowledged (--replicas 2).",
            ["shard"], registry=registry, buckets=SECONDS_BUCKETS)
        store.applier.on_apply.append(self.apply_seconds.labels(self.shard).observe)

    def observe_wait(self, seconds: float, sync: str) -> None:
        self.wait_seconds.labels(self.shard, sync).observe(seconds)

    def rpc_error(self, method: str, code: str) -> None:
        self.rpc_errors.labels(self.shard, method, code).inc()
