#!/usr/bin/env python
"""Latency benchmark: one small model (4 KB by default), one server, one worker, push+pull rounds.

(Over 400 lines: the raw gRPC ceiling, its server and the three paths measured
against it run in one process, so that every ratio comes from one run.)

Times ``--rounds`` push+pull rounds (after ``--warmup`` untimed ones) of a
model of one fp32 tensor of ``--elements`` elements (1024: 4 KB) through
one shard on loopback, and the same bytes through raw gRPC as the ceiling:

* ``raw``: a minimal gRPC server with a generic handler and identity (bytes)
  serializers, no protobuf, no torch: a round is a unary ``Push`` (the
  bytes in, their length back) and a unary ``Pull`` (the bytes back), the
  client copying tensor memory -> message and message -> tensor memory.
* ``push+pull``: ``PSClient.push(grads, step=i)`` then
  ``PSClient.pull(out=...)``, ``sync="asp"``, SGD with lr = 0.
* ``step asp`` / ``step bsp``: ``DistributedOptimizer.step()`` (what a
  training loop calls: push the gradient, pull the weights into the
  parameter in place) under asp and under bsp, each its own job.

``--server process`` (what a user runs) starts every shard as a ``shardps
server`` process and the raw server as a process of this script;
``--server inprocess`` runs them all in this process
(``LocalCluster(processes=False)``); ``both`` (the default) measures the two
forms in one run. The raw server in this process is measured in every run,
as the baseline ceiling. The systems take turns in blocks of ``--block``
rounds, so background load on a shared machine hits all alike. Reported per
system: p50, p90, p99 and max of the round time in ms, and the p50 and p99
ratios to the raw server of the same form (1.0: as fast as raw gRPC). Every
RPC has a deadline (``--rpc-timeout``), the whole run a watchdog
(``--max-seconds``), and every process started is stopped on the way out,
on error too. The run fails if the pulled data differs from what was sent
(lr = 0 keeps the weights; the raw server echoes what it got).


    .venv/bin/python benchmarks/latency.py [--rounds 2000] [--server both] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from guard import run_guarded

RAW_SERVICE = "shardps_bench.RawUnary"
RAW_READY = "raw grpc server listening on "
FORMS = ("inprocess", "process")
SYSTEMS = ("raw", "push+pull", "step asp", "step bsp")
# Every child process started, for the watchdog's last resort.
_CHILDREN: list[subprocess.Popen[str]] = []


# -- the raw gRPC server (in this process, or as `latency.py --serve-raw`) -----


def start_raw(host: str) -> tuple[grpc.Server, str]:
    """A minimal bytes-in/bytes-out unary gRPC server: no protobuf, no torch."""
    lock = threading.Lock()
    kept = [b""]

    def push(request: bytes, context: grpc.ServicerContext) -> bytes:
        with lock:
            kept[0] = request
        return len(request).to_bytes(8, "little")

    def pull(request: bytes, context: grpc.ServicerContext) -> bytes:
        with lock:
            return kept[0]

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Push": grpc.unary_unary_rpc_method_handler(push),  # no (de)serializers: bytes as they are
        "Pull": grpc.unary_unary_rpc_method_handler(pull),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise RuntimeError(f"could not bind {host}:0")
    server.start()
    return server, f"{host}:{port}"


def serve_raw(host: str) -> int:
    server, address = start_raw(host)

    def on_signal(signum: int, frame: object) -> None:
        server.stop(grace=None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"{RAW_READY}{address}", flush=True)
    server.wait_for_termination()
    return 0



def push_pull_rounds(client: Any, grads: dict[str, Any], out: dict[str, Any]) -> Callable[[], float]:
    """A round function: ``client.push`` of the next step then ``client.pull`` into ``out``; its seconds."""
    step = [client.clock]

    def round_() -> float:
        t = time.perf_counter()
        client.push(grads, step=step[0])
        client.pull(out=out)
        dt = time.perf_counter() - t
        step[0] += 1
        return dt

    return round_

class RawClient:
    """Push: the tensor's bytes to the raw server; pull: its echo into an output tensor."""

    def __init__(self, address: str, timeout: float) -> None:
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address)
        self._push = self.channel.unary_unary(f"/{RAW_SERVICE}/Push")
        self._pull = self.channel.unary_unary(f"/{RAW_SERVICE}/Pull")
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def push(self, src: memoryview) -> None:
        got = int.from_bytes(self._push(bytes(src), timeout=self.timeout), "little")  # the one copy
        if got != len(src):
            raise RuntimeError(f"raw server took {got} bytes, sent {len(src)}")

    def pull(self, dst: memoryview) -> None:
        data = self._pull(b"", timeout=self.timeout)
        if len(data) != len(dst):
            raise RuntimeError(f"raw server sent {len(data)} bytes, expected {len(dst)}")
        dst[:] = data  # the one copy

    def close(self) -> None:
        self.channel.close()


# -- measuring -------------------------------------------------------------------


def percentiles(xs: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, max and mean of ``xs`` (seconds) in ms; p as the nearest rank."""
    s = sorted(xs)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))] * 1e3

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": s[-1] * 1e3,
            "mean": statistics.fmean(s) * 1e3, "n": len(s)}


class Bench:
    """Every system of one run and the clean-up of what it started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stack: list[Callable[[], None]] = []  # clean-ups, run last first
        self.rounds: dict[tuple[str, str], Callable[[], float]] = {}  # (form, system) -> one timed round
        self.checks: list[Callable[[], tuple[str, bool]]] = []

    def log(self, *a: object) -> None:
        if not self.args.quiet:
            print(*a, file=sys.stderr, flush=True)

    def close(self) -> None:
        while self.stack:
            try:
                self.stack.pop()()
            except Exception as e:  # noqa: BLE001 - still stop the rest
                print(f"clean-up: {e}", file=sys.stderr)

    def add_raw(self, form: str) -> None:
        import torch

        a = self.args
        if form == "inprocess":
            server, address = start_raw("127.0.0.1")
            self.stack.append(lambda: server.stop(grace=None).wait(10))
        else:
            from shardps.deploy.local import read_ready, stop_processes

            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-raw"],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
            _CHILDREN.append(proc)
            self.stack.append(lambda: stop_processes([proc]))
            address = read_ready(proc, a.startup_timeout, RAW_READY).split()[0]
        client = RawClient(address, a.rpc_timeout)
        self.stack.append(client.close)
        gen = torch.Generator().manual_seed(1)
        src = torch.randn(a.elements, generator=gen)
        dst = torch.empty_like(src)
        src_mv = memoryview(src.numpy()).cast("B")
        dst_mv = memoryview(dst.numpy()).cast("B")

        def round_() -> float:
            t = time.perf_counter()
            client.push(src_mv)
            client.pull(dst_mv)
            return time.perf_counter() - t

        self.rounds[(form, "raw")] = round_
        self.checks.append(lambda: (f"{form} raw", torch.equal(src, dst)))

    def add_shardps(self, form: str, system: str) -> None:
        import torch

        import shardps

        a = self.args
        cluster = shardps.LocalCluster(1, processes=form == "process", startup_timeout=a.startup_timeout,
                                       max_wait_s=a.rpc_timeout)
        self.stack.append(cluster.stop)
        try:
            cluster.start()
        finally:
            _CHILDREN.extend(getattr(cluster, "_procs", []))
        client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, timeout=a.rpc_timeout,
                                 ready_timeout=a.startup_timeout)
        self.stack.append(client.close)
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(a.elements, generator=gen)
        grad = torch.randn(a.elements, generator=gen)
        sgd = shardps.optim.SGD(lr=0.0)
        if system == "push+pull":
            client.register({"w": weight}, sgd, sync="asp")
            out = {"w": torch.empty_like(weight)}
            grads = {"w": grad}
            round_ = push_pull_rounds(client, grads, out)

            self.checks.append(lambda: (f"{form} {system}", torch.equal(out["w"], weight)))
        else:
            model = torch.nn.Module()
            model.w = torch.nn.Parameter(weight.clone())
            opt = shardps.DistributedOptimizer(model, client, optimizer=sgd, sync=system.split()[1])
            model.w.grad = grad

            def round_() -> float:
                t = time.perf_counter()
                opt.step()
                return time.perf_counter() - t

            self.checks.append(lambda: (f"{form} {system}", torch.equal(model.w.detach(), weight)))
        self.rounds[(form, system)] = round_

    def run(self) -> dict[str, Any]:
        import torch

        a = self.args
        forms = FORMS if a.server == "both" else (a.server,)
        t0 = time.perf_counter()
        self.add_raw("inprocess")
        for form in forms:
            if form == "process":
                self.add_raw("process")
            for system in SYSTEMS[1:]:
                self.add_shardps(form, system)
        self.log(f"servers up in {time.perf_counter() - t0:.1f}s: {len(self.rounds)} systems")
        keys = list(self.rounds)
        times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
        for k in keys:
            for _ in range(a.warmup):
                self.rounds[k]()
        t0 = time.perf_counter()
        done = 0
        order = list(keys)
        while done < a.rounds:
            n = min(a.block, a.rounds - done)
            for k in order:
                fn, out = self.rounds[k], times[k]
                for _ in range(n):
                    out.append(fn())
            order = order[1:] + order[:1]  # the next block starts with the next system
            done += n
            self.log(f"{done}/{a.rounds} rounds per system ({time.perf_counter() - t0:.1f}s)")
        bad = [name for name, ok in (c() for c in self.checks) if not ok]
        if bad:
            raise RuntimeError(f"data check failed: {bad}")

        results: list[dict[str, Any]] = []
        for (form, system), xs in times.items():
            base = times[("inprocess" if form == "inprocess" else "process", "raw")]
            r, b = percentiles(xs), percentiles(base)
            results.append({"server": form, "system": system, **r,
                            "ratio_p50": r["p50"] / b["p50"], "ratio_p99": r["p99"] / b["p99"]})
        import shardps

        return {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "grpcio": grpc.__version__,
                        "torch": torch.__version__, "shardps": shardps.__version__,
                        "loadavg": list(os.getloadavg())},
            "model": {"elements": a.elements, "bytes": a.elements * 4, "dtype": "float32"},
            "rounds": a.rounds, "warmup": a.warmup, "block": a.block, "servers": list(forms),
            "results": results,
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    try:
        return bench.run()
    finally:
        bench.close()


def report(res: dict[str, Any]) -> str:
    m = res["model"]
    lines = [
        f"latency: {m['bytes']} B model (one fp32 tensor of {m['elements']}), 1 server, 1 worker, "
        f"{res['rounds']} rounds per system (after {res['warmup']} warm-up), {res['machine']['cpus']} CPUs",
        f"{'server':10}{'system':14}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}"
        f"{'p50/raw':>9}{'p99/raw':>9}",
    ]
    for r in res["results"]:
        lines.append(f"{r['server']:10}{r['system']:14}{r['p50']:9.3f}{r['p90']:9.3f}{r['p99']:9.3f}"
                     f"{r['max']:9.3f}{r['ratio_p50']:9.2f}{r['ratio_p99']:9.2f}")
    lines.append("(a round: push then pull; raw: unary gRPC with bytes, the same server form; "
                 "ratio: system / raw)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2000, help="timed rounds per system (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="untimed rounds per system first (default 200)")
    p.add_argument("--elements", type=int, default=1024,
                   help="fp32 elements of the model's one tensor (default 1024: 4 KB)")
    p.add_argument("--server", choices=("process", "inprocess", "both"), default="both",
                   help="shardps server as a process, in this process, or both in one run (default both)")
    p.add_argument("--block", type=int, default=100,
                   help="rounds a system runs before the next takes its turn (default 100)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="deadline of every RPC, seconds (default 30)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for servers to come up (default 60)")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="watchdog: abort the whole run after this many seconds (default 600)")
    p.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_raw:
        return serve_raw("127.0.0.1")
    if args.rounds < 1 or args.warmup < 0 or args.elements < 1 or args.block < 1:
        p.error("need --rounds >= 1, --warmup >= 0, --elements >= 1, --block >= 1")

    res = run_guarded("latency.py", args.max_seconds, lambda: run(args), lambda: _CHILDREN)
    if res is None:
        return 130
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
