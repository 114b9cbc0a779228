"""Prometheus metrics of one worker: training loss, step time, push/pull time, its model's MoE layers.

Created on the registry passed in; every sample carries the label ``worker``.
``DistributedOptimizer(metrics=WorkerMetrics(registry, worker_id))`` records
step, push and pull times itself; the loss comes from ``opt.record_loss``.
``serve_worker_metrics`` serves them on their own registry (what a client
given ``metrics_port`` does once it registers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shardps.exposition import MetricsEndpoint, serve_metrics
from shardps.protos import env

if TYPE_CHECKING:  # no torch import for what only serves metrics
    from torch import nn

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker_id: int) -> None:
        w = str(worker_id)
        self.registry = registry
        self.models: set[int] = set()  # the models whose MoE layers are collected here (``add_moe``), by id
        self.loss = Gauge("shardps_worker_loss", "The training loss last reported by the worker.",
                          ["worker"], registry=registry).labels(w)
        self.step_seconds = Histogram("shardps_worker_step_seconds",
                                      "Wall time between consecutive optimizer steps (compute + sync).",
                                      ["worker"], registry=registry, buckets=SECONDS_BUCKETS).labels(w)
        self.push_seconds = Histogram("shardps_worker_push_seconds", "Time to push gradients to all shards.",
                                      ["worker"], registry=registry, buckets=SECONDS_BUCKETS).labels(w)
        self.pull_seconds = Histogram("shardps_worker_pull_seconds",
                                      "Time to pull weights from all shards (barrier/SSP waits included).",
                                      ["worker"], registry=registry, buckets=SECONDS_BUCKETS).labels(w)
        self.steps = Counter("shardps_worker_steps_total", "Optimizer steps (calls of step()).",
                             ["worker"], registry=registry).labels(w)
        self.clock = Gauge("shardps_worker_clock_steps_pushed", "Steps this worker has pushed.",
                           ["worker"], registry=registry).labels(w)

    def add_moe(self, model: nn.Module) -> None:
        """Collect the MoE layers of ``model`` here too (``shardps_moe_*``, worker/experts/moe.py's ``MoECollector``),
        once per model; a model without any adds nothing."""
        from shardps.worker.experts.moe import MoE, MoECollector

        if id(model) in self.models or not any(isinstance(m, MoE) for m in model.modules()):
            return
        self.models.add(id(model))
        self.registry.register(MoECollector(model))


def serve_worker_metrics(worker_id: int, host: str, port: int) -> tuple[WorkerMetrics, MetricsEndpoint]:
    """A worker's metrics on a registry of their own, served at http://host:port/metrics (port 0: a free one)."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, worker_id)
    try:
        endpoint = serve_metrics(registry, host, port)
    except OSError as e:
        raise OSError(f"worker {worker_id}: cannot serve metrics on {host}:{port} (metrics_port or "
                      f"{env.METRICS_PORT}): {e.strerror}") from None
    return metrics, endpoint
