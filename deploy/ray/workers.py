"""Workers as Ray actors, each running the user's ``train_loop(ctx)`` against the servers.

Why plain actors and not Ray Train's ``DataParallelTrainer``: see
docs/ray.md (in short: Train restarts the whole worker group when one
worker dies, while shardps lets the others go on after the lost worker's
lease; and ``ray.train`` needs the ``ray[train]`` extra, pandas and pyarrow
included, for nothing shardps uses).

::

    def train_loop(ctx):
        model = make_model()
        opt = shardps.DistributedOptimizer(model, ctx.client, optimizer=shardps.optim.Adam(), sync="bsp")
        for step, (x, y) in enumerate(batches(ctx.worker_id, ctx.num_workers)):
            ...
            ctx.report({"step": step, "loss": loss.item()})
        return final_metrics

    with shardps.ray.start_servers(2) as servers:
        results = shardps.ray.run_workers(train_loop, servers, num_workers=4)

A worker whose training loop raises stops the run (the others are stopped,
the error is raised with its traceback). A worker actor that dies (its
process killed, its node lost) does not: the others go on (under bsp and
every:X once the lost worker's lease expires) and ``WorkersFailed`` is
raised at the end with every result that was returned.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from shardps.deploy.ray.placement import (
    DEFAULT_PLACEMENT_TIMEOUT_S,
    actor_logging,
    check_strategy,
    in_bundle,
    place,
)
from shardps.protos.security import Security

log = logging.getLogger("shardps.ray")


class WorkersFailed(RuntimeError):
    """Some worker actors died; ``results`` holds what the others returned, ``errors`` why each failed."""

    def __init__(self, results: dict[int, Any], errors: dict[int, BaseException]) -> None:
        lines = "; ".join(f"worker {k}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          for k, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} of {len(results) + len(errors)} workers failed ({lines})")
        self.results, self.errors = results, errors


@dataclass
class WorkerContext:
    """What a training loop gets: who it is, the servers, a connected client, ``report``."""

    worker_id: int
    num_workers: int
    addresses: list[str]
    backups: list[str] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    node_id: str = ""
    security: Security | None = None
    metrics_port: int | None = None
    connect_options: dict[str, Any] = field(default_factory=dict)
    _client: Any = None
    _reports: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def client(self) -> Any:
        """A ``PSClient`` connected to every shard as this worker (made on first use, closed after the loop)."""
        if self._client is None:
            from shardps.worker.client import connect

            # Its /metrics on the node's address, where a Prometheus elsewhere can scrape it.
            host = ray.util.get_node_ip_address() if self.metrics_port is not None else None
            self._client = connect(self.addresses, worker_id=self.worker_id, num_workers=self.num_workers,
                                   backups=self.backups or None, security=self.security,
                                   metrics_port=self.metrics_port, metrics_host=host, **self.connect_options)
        return self._client

    @property
    def device(self) -> Any:
        """The CUDA device Ray gave this worker, else the CPU."""
        import torch

        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def report(self, metrics: dict[str, Any]) -> None:
        """Hand metrics to the driver (``run_workers(on_report=...)`` gets them while the loop runs)."""
        with self._lock:
            self._reports.append({"worker_id": self.worker_id, "time": time.time(), **metrics})

    def take_reports(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()  # says goodbye: barriers go on without this worker
            self._client = None  # a next run connects again


class WorkerActor:
    """Runs one worker's training loop; a second thread answers ``take_reports`` meanwhile."""

    def __init__(self, spec: dict[str, Any]) -> None:
        actor_logging()
        self.ctx = WorkerContext(**spec, node_id=ray.get_runtime_context().get_node_id())

    def info(self) -> dict[str, Any]:
        c = self.ctx
        metrics = c._client.metrics_endpoint.address if c._client is not None and c._client.metrics_endpoint else ""
        return {"worker_id": c.worker_id, "node_id": c.node_id, "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "metrics_address": metrics}

    def run(self, train_loop: Callable[[WorkerContext], Any]) -> Any:
        try:
            return train_loop(self.ctx)
        finally:
            self.ctx.close()

    def take_reports(self) -> list[dict[str, Any]]:
        return self.ctx.take_reports()


class WorkerGroup:
    """``num_workers`` worker actors placed by a placement group; ``run(train_loop)`` on all of them."""

    def __init__(self, servers: Any, num_workers: int, *, use_gpu: bool = False, num_cpus: float = 1.0,
                 resources_per_worker: dict[str, float] | None = None, strategy: str = "SPREAD",
                 placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT_S, config: dict[str, Any] | None = None,
                 security: Security | None = None, metrics: bool = False,
                 connect_options: dict[str, Any] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        addresses = list(servers.addresses if hasattr(servers, "addresses") else servers)
        backups = list(getattr(servers, "backup_addresses", []) or []) or None
        if security is None:
            security = getattr(servers, "security", None)
        strategy = check_strategy(strategy)
        bundle: dict[str, float] = {"CPU": float(num_cpus), **(resources_per_worker or {})}
        if use_gpu:
            bundle["GPU"] = 1.0
        self.placement_group = place([dict(bundle) for _ in range(num_workers)], strategy, timeout=placement_timeout,
                                     what=f"shardps workers ({num_workers})")
        self.actors: list[Any] = []
        try:
            cls = ray.remote(WorkerActor)
            for k in range(num_workers):
                spec = {"worker_id": k, "num_workers": num_workers, "addresses": addresses, "backups": backups,
                        "config": dict(config or {}), "security": security,
                        "metrics_port": 0 if metrics else None, "connect_options": dict(connect_options or {})}
                self.actors.append(cls.options(num_cpus=num_cpus, num_gpus=1 if use_gpu else 0,
                                               resources=resources_per_worker or {}, max_concurrency=2,
                                               **in_bundle(self.placement_group, k)).remote(spec))
            self.infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in self.actors], timeout=300)
        except BaseException:
            self.shutdown()
            raise
        self._closed = False

    @property
    def node_ids(self) -> list[str]:
        return [i["node_id"] for i in self.infos]

    @property
    def pids(self) -> list[int]:
        return [i["pid"] for i in self.infos]

    def run(self, train_loop: Callable[[WorkerContext], Any], *,
            on_report: Callable[[dict[str, Any]], None] | None = None, timeout: float | None = None,
            poll_s: float = 0.5) -> list[Any]:
        """Run ``train_loop(ctx)`` on every worker; their return values in worker order.

        ``on_report`` is called on the driver with each ``ctx.report(...)``
        as it arrives. ``timeout``: give up (TimeoutError naming the
        unfinished workers) after that many seconds.
        """
        refs = {a.run.remote(train_loop): k for k, a in enumerate(self.actors)}
        pending = dict(refs)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            wait_s = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
            for ref in done:
                k = pending.pop(ref)
                try:
                    results[k] = ray.get(ref)
                except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                    log.warning("worker %d died (%s); the others go on", k, type(e).__name__)
                    errors[k] = e
                except RayTaskError:  # the loop itself raised: stop everything, raise its error
                    self.shutdown()
                    raise
            self._forward_reports(on_report, [k for k in range(len(self.actors)) if k not in errors])
            if pending and deadline is not None and time.monotonic() >= deadline:
                self.shutdown()
                raise TimeoutError(f"workers {sorted(pending.values())} did not finish within {timeout:.0f}s")
        if errors:
            raise WorkersFailed(results, errors)
        return [results[k] for k in range(len(self.actors))]

    def _forward_reports(self, on_report: Callable[[dict[str, Any]], None] | None, workers: Sequence[int]) -> None:
        if on_report is None:
            return
        refs = [self.actors[k].take_reports.remote() for k in workers]
        for ref in refs:
            try:
                batch = ray.get(ref, timeout=60)
            except RayActorError:  # died since: its run reports that
                continue
            for r in batch:
                on_report(r)

    def shutdown(self) -> None:
        """End the worker actors and free their bundles (idempotent)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.placement_group)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def run_workers(train_loop: Callable[[WorkerContext], Any], servers: Any, num_workers: int, *,
                on_report: Callable[[dict[str, Any]], None] | None = None, timeout: float | None = None,
                **options: Any) -> list[Any]:
    """Run ``train_loop(ctx)`` on ``num_workers`` worker actors against ``servers`` (a ``ServerGroup``
    or the shards' addresses); each worker's return value, in worker order.

    ``options``: those of ``WorkerGroup`` (``use_gpu``, ``num_cpus``,
    ``resources_per_worker``, ``strategy``, ``placement_timeout``,
    ``config`` (``ctx.config``), ``security``, ``metrics``,
    ``connect_options``). The actors and their placement group are freed
    when it returns or raises.
    """
    with WorkerGroup(servers, num_workers, **options) as group:
        return group.run(train_loop, on_report=on_report, timeout=timeout)
