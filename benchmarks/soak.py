#!/usr/bin/env python
"""Soak: 32 workers pushing and pulling at once for a bounded time, then an exact check of the state.

Starts ``shardps.LocalCluster(--shards, processes=True)`` (default 2
``shardps server`` processes on loopback) and ``--clients`` worker threads
(default 32), each its own ``PSClient`` (its own channels) and its own
worker of a job of ``num_workers = --clients``, ``sync="asp"``,
``shardps.optim.SGD(lr=1.0)``. Until ``--seconds`` have passed, every
worker loops: ``pull()`` all tensors, then ``push()`` a gradient for all of
them with its next step. Worker k's gradient is the constant
``(k + 1) / 1024`` everywhere and the initial weights are small integers,
so every value the shards ever hold is a multiple of 1/1024 well inside
fp32's 24-bit mantissa: every update is exact whatever the order, and after
the run each weight must equal

    initial - lr * sum_k (k + 1) / 1024 * pushes_k

exactly, where pushes_k counts worker k's steps acknowledged by every shard.
A push that fails is retried with the same step (a step a shard already has
is acknowledged as a duplicate and not applied again), so none is half
applied. Under asp each shard applies every step on arrival: its version
must end at the total number of steps.

Reported: requests and errors (by status code), p50 / p99 / max latency of
push and of pull (each call of the client, all shards in parallel),
throughput, and the checks: the final weights, each shard's version and
counters, and that every worker saw the shards' versions only go up.

``--replicas 2 --kill-after S`` gives every shard a backup and kills
server 1 with SIGKILL S seconds into the run: the workers fail over to its
backup, and the same exact check must hold (no acknowledged push lost, none
applied twice), on the shards as they are served at the end.

Every RPC has a deadline (``--rpc-timeout``), the whole run a watchdog
(``--max-seconds``), and the server processes are stopped on the way out,
on an error, on SIGTERM and when the watchdog fires.

    .venv/bin/python benchmarks/soak.py [--seconds 20] [--clients 32] [--json]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import torch
from guard import cluster_processes, run_guarded

import shardps

SCALE = 1.0 / 1024  # gradients are multiples of this: exact in fp32 for the sums reached here
_CLUSTERS: list[shardps.LocalCluster] = []  # for the watchdog's last resort


def initial_tensors(numel: int) -> dict[str, torch.Tensor]:
    """Small integers (exact), different per element so that a misplaced chunk shows."""
    def ramp(*shape: int) -> torch.Tensor:
        return (torch.arange(math.prod(shape), dtype=torch.float32) % 61).reshape(shape)

    rows = max(1, numel // 64)
    return {"w": ramp(rows, 64), "b": ramp(64), "v": ramp(max(1, numel // 4))}


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs, in ms."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return 1000 * s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class Worker:
    """One worker thread: pull, push, repeat until told to stop; records latencies and errors."""

    def __init__(self, k: int, addresses: Sequence[str], num_workers: int, tensors: dict[str, torch.Tensor],
                 args: argparse.Namespace) -> None:
        self.k = k
        self.client = shardps.connect(addresses, worker_id=k, num_workers=num_workers, timeout=args.rpc_timeout)
        self.tensors = tensors
        self.grads = {n: torch.full_like(t, (k + 1) * SCALE) for n, t in tensors.items()}
        self.out = {n: torch.empty_like(t) for n, t in tensors.items()}
        self.push_s: list[float] = []
        self.pull_s: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.error_examples: list[str] = []
        self.steps = 0  # steps every shard acknowledged
        self.duplicates = 0
        self.versions_went_back = 0
        self.unsettled = False  # a step whose push never got through on every shard
        self.max_retries = args.max_retries

    def register(self) -> None:
        self.client.register(self.tensors, shardps.optim.SGD(lr=1.0), sync="asp")

    def _error(self, e: BaseException) -> None:
        code = e.code.name if isinstance(e, shardps.ShardError) else type(e).__name__
        self.errors[code] += 1
        if len(self.error_examples) < 3:
            self.error_examples.append(str(e)[:300])

    def _push(self) -> bool:
        """Push the next step until every shard has it (or the retries run out)."""
        for _ in range(self.max_retries + 1):
            t0 = time.perf_counter()
            try:
                res = self.client.push(self.grads, step=self.steps)
            except (shardps.ShardError, grpc.RpcError) as e:
                self._error(e)
                continue
            self.push_s.append(time.perf_counter() - t0)
            self.duplicates += sum(r.duplicate for r in res)
            self.steps += 1
            return True
        self.unsettled = True
        return False

    def run(self, stop: threading.Event) -> None:
        try:
            self._loop(stop)
        except Exception:  # noqa: BLE001 - a run cut short (Ctrl-C, the watchdog) closes the clients under us
            if not stop.is_set():
                raise

    def _loop(self, stop: threading.Event) -> None:
        last = list(self.client.versions)
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                self.client.pull(out=self.out)
            except (shardps.ShardError, grpc.RpcError) as e:
                self._error(e)
                continue
            self.pull_s.append(time.perf_counter() - t0)
            now = list(self.client.versions)
            self.versions_went_back += sum(b < a for a, b in zip(last, now))
            last = now
            if not self._push():
                return

    def close(self) -> None:
        self.client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    tensors = initial_tensors(args.numel)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    cluster = shardps.LocalCluster(args.shards, processes=True, startup_timeout=args.startup_timeout,
                                   replicas=args.replicas)
    _CLUSTERS.append(cluster)
    with cluster:
        workers = [Worker(k, cluster.addresses, args.clients, tensors, args) for k in range(args.clients)]
        stop = threading.Event()
        try:
            # Worker 0 creates the tensors; the others wait for them (up to their deadline).
            threads = [threading.Thread(target=w.register, daemon=True) for w in workers]
            for th in threads:
                th.start()
            for th in threads:
                th.join(args.rpc_timeout + 10)
            if any(th.is_alive() for th in threads):
                raise TimeoutError("registration did not finish")
            threads = [threading.Thread(target=w.run, args=(stop,), name=f"worker{w.k}", daemon=True)
                       for w in workers]
            if not args.quiet:
                print(f"soak.py: {args.clients} workers on {args.shards} shard processes for {args.seconds:.0f}s, "
                      f"{nbytes} bytes per push and per pull", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            for th in threads:
                th.start()
            killed_at = None
            if args.kill_after is not None:
                stop.wait(args.kill_after)
                cluster.kill(1)
                killed_at = round(time.monotonic() - t0, 2)
                if not args.quiet:
                    print(f"soak.py: killed server 1 (SIGKILL) at {killed_at}s", file=sys.stderr, flush=True)
            stop.wait(max(0.0, args.seconds - (time.monotonic() - t0)))
            stop.set()
            for th in threads:  # each finishes its pull/push pair: bounded by the RPC deadlines and retries
                th.join(args.rpc_timeout * (args.max_retries + 2) + 10)
            elapsed = time.monotonic() - t0
            hung = [th.name for th in threads if th.is_alive()]

            steps = [w.steps for w in workers]
            expected = {n: t - 1.0 * SCALE * sum((k + 1) * s for k, s in enumerate(steps)) for n, t in tensors.items()}
            with shardps.connect(cluster.serving_addresses(), worker_id=0, num_workers=args.clients,
                                 timeout=args.rpc_timeout) as checker:
                checker.attach()
                final = checker.pull()
                stats = checker.stats()
        finally:
            stop.set()
            for w in workers:
                w.close()
    total_steps = sum(steps)
    mismatch = {n: int((final[n] != expected[n]).sum()) for n in tensors}
    max_err = max(float((final[n] - expected[n]).abs().max()) for n in tensors)
    push_s = [x for w in workers for x in w.push_s]
    pull_s = [x for w in workers for x in w.pull_s]
    errors: collections.Counter[str] = collections.Counter()
    for w in workers:
        errors.update(w.errors)
    shard_checks = [{
        "shard": s["shard_index"], "version": s["version"], "pushes_total": s["pushes_total"],
        "duplicate_pushes_total": s["duplicate_pushes_total"], "gradients_applied_total": s["gradients_applied_total"],
        "version_ok": s["version"] == total_steps and s["gradients_applied_total"] == total_steps,
    } for s in stats]
    exact = all(n == 0 for n in mismatch.values())
    ok = (exact and not hung and not any(w.unsettled for w in workers) and all(c["version_ok"] for c in shard_checks)
          and not any(w.versions_went_back for w in workers))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "grpcio": grpc.__version__, "platform": platform.platform()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet", "json")},
        "bytes_per_request": nbytes,
        "elapsed_s": round(elapsed, 2),
        "requests": {"push": len(push_s), "pull": len(pull_s), "total": len(push_s) + len(pull_s)},
        "requests_per_s": round((len(push_s) + len(pull_s)) / elapsed, 1),
        "errors": sum(errors.values()),
        "errors_by_code": dict(errors),
        "error_examples": [e for w in workers for e in w.error_examples][:5],
        "latency_ms": {
            op: {"p50": round(percentile(xs, 50), 2), "p99": round(percentile(xs, 99), 2),
                 "max": round(1000 * max(xs), 2) if xs else None, "n": len(xs)}
            for op, xs in (("push", push_s), ("pull", pull_s))
        },
        "steps_per_worker": {"min": min(steps), "max": max(steps), "total": total_steps},
        "client_duplicates": sum(w.duplicates for w in workers),
        "killed_server_1_at_s": killed_at,
        "failovers": sum(w.client.failovers_total for w in workers),
        "versions_went_back": sum(w.versions_went_back for w in workers),
        "hung_workers": hung,
        "unsettled_workers": [w.k for w in workers if w.unsettled],
        "final_state_exact": exact,
        "mismatched_elements": mismatch,
        "max_abs_error": max_err,
        "shards": shard_checks,
        "ok": ok,
    }


def report(res: dict[str, Any]) -> str:
    s = res["settings"]
    lat = res["latency_ms"]
    lines = [
        f"soak.py {res['date']}: {s['clients']} workers, {s['shards']} shard processes, asp, SGD(lr=1.0), "
        f"{res['bytes_per_request']} bytes per push/pull, {res['elapsed_s']} s",
        f"requests: {res['requests']['total']} ({res['requests']['push']} push, {res['requests']['pull']} pull), "
        f"{res['requests_per_s']}/s; errors: {res['errors']} {res['errors_by_code'] or ''}",
        f"push latency ms: p50 {lat['push']['p50']}, p99 {lat['push']['p99']}, max {lat['push']['max']}",
        f"pull latency ms: p50 {lat['pull']['p50']}, p99 {lat['pull']['p99']}, max {lat['pull']['max']}",
        f"steps per worker: {res['steps_per_worker']['min']}-{res['steps_per_worker']['max']}, "
        f"total {res['steps_per_worker']['total']}; duplicates acknowledged: {res['client_duplicates']}",
        f"replicas: {res['settings']['replicas']}; server 1 killed at: {res['killed_server_1_at_s']}s; "
        f"worker failovers: {res['failovers']}",
        f"final weights == initial - lr * sum of gradients, exactly: {res['final_state_exact']} "
        f"(mismatched elements {res['mismatched_elements']}, max abs error {res['max_abs_error']})",
    ]
    for c in res["shards"]:
        lines.append(f"shard {c['shard']}: version {c['version']}, gradients applied {c['gradients_applied_total']}, "
                     f"pushes {c['pushes_total']} ({c['duplicate_pushes_total']} duplicates): "
                     f"{'ok' if c['version_ok'] else 'WRONG'}")
    lines.append(f"versions seen going back: {res['versions_went_back']}; hung workers: {res['hung_workers'] or 0}; "
                 f"unsettled pushes: {res['unsettled_workers'] or 0}")
    lines.append("OK" if res["ok"] else "FAILED")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="how long the workers push and pull (default 20)")
    p.add_argument("--clients", type=int, default=32, help="worker threads, one PSClient each (default 32)")
    p.add_argument("--shards", type=int, default=2, help="shard server processes (default 2)")
    p.add_argument("--numel", type=int, default=16384,
                   help="elements of the largest tensor; 1.3x this many fp32 in all (default 16384)")
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="deadline of every RPC, seconds (default 30)")
    p.add_argument("--max-retries", type=int, default=3, help="retries of a failed push, same step (default 3)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for servers to come up (default 60)")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="watchdog: abort the whole run after this many seconds (default 600)")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=1, help="2: every shard has a backup (default 1)")
    p.add_argument("--kill-after", type=float, default=None, metavar="S",
                   help="with --replicas 2: SIGKILL server 1 S seconds into the run")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1 or args.shards < 1 or args.numel < 64 or args.max_retries < 0:
        p.error("need --seconds > 0, --clients >= 1, --shards >= 1, --numel >= 64, --max-retries >= 0")
    if args.kill_after is not None and not (args.replicas == 2 and args.shards >= 2 and
                                            0 <= args.kill_after < args.seconds):
        p.error("--kill-after needs --replicas 2, --shards >= 2 and a time within --seconds")
    if args.replicas == 2 and args.shards < 2:
        p.error("--replicas 2 needs --shards >= 2")

    res = run_guarded("soak.py", args.max_seconds, lambda: run(args), lambda: cluster_processes(_CLUSTERS))
    if res is None:
        return 130
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 0 if res["ok"] and res["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
