#!/usr/bin/env python
"""shardps against its peers, end to end: DDP (gloo), a Ray object-store parameter server, shardps.

    .venv/bin/python benchmarks/peers.py [--params 25e6] [--workers 2] [--servers 2] [--rounds 3] [--json]
    .venv/bin/python benchmarks/peers.py --sweep [--plot sweep.png]

One run, one machine, the same workload for every system: an MLP
(``--dims``, default 2048-4096-4096-10, 25.2M parameters), ``--batch`` 64 per
worker, SGD (lr 0.01), ``--workers`` worker processes of ``--threads`` torch
threads each, ``--steps`` timed steps after ``--warmup`` untimed ones. The
systems, one after the other:

- ``ddp``: torch DistributedDataParallel, gloo, 25 MB buckets overlapped with
  backward (``baselines/ddp.py``);
- ``ray-ps``: one parameter-server actor and worker actors exchanging numpy
  weights and gradients through Ray's object store, as Ray's documented
  parameter-server example does (``baselines/ray_ps.py``; on a local Ray
  started for it);
- shardps: ``--servers`` ``shardps server`` processes (``LocalCluster``) and
  worker processes calling ``DistributedOptimizer.step()``, under bsp, asp
  and every:4, fp32 or bf16 on the wire (bf16: gradients up and weights
  down), overlap off or on (``overlap=True``: buckets pushed during
  backward, weights pulled during the next forward).

A step is forward + backward + sync + optimizer step, timed in each worker
(in the driver's loop for ray-ps, whose workers move in lockstep); the
table gives the mean over the timed steps and workers (every:4 syncs one
step in four: the mean counts them all), the ratio to DDP's, and "RayPS/x",
the Ray parameter server's step over this one (above 1: faster than it). "wire MB"
is the tensor payload one worker sends and receives per step, framing
excluded: shardps pushes gradients and pulls weights (each fp32 or bf16)
once per sync; DDP's ring all-reduce moves 2 (W-1)/W of the gradients each
way; the Ray workers receive the weights and send their gradients.

``--sweep``: shardps bsp (fp32) step time against servers (1, 2, 4), workers
(1, 2, 4) and model size (1M, 10M, 25M, 100M parameters), each varied around
the defaults, with DDP at the same point beside it; ``--plot PNG`` draws it.

Absolute times drift on a shared machine: compare ratios from one run, and
use ``--rounds`` (each configuration that many times, in rotating order; the
median counts) where other work shares the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import common  # noqa: E402
from guard import run_guarded  # noqa: E402

HERE = Path(__file__).resolve().parent
# (sync, wire, overlap): "bf16" on the wire is both ways (grad_dtype and pull_dtype)
SHARDPS_CONFIGS = [("bsp", "fp32", "off"), ("bsp", "fp32", "on"), ("bsp", "bf16", "off"), ("bsp", "bf16", "on"),
                   ("asp", "fp32", "off"), ("asp", "fp32", "on"), ("asp", "bf16", "on"),
                   ("every:4", "fp32", "off"), ("every:4", "fp32", "on"), ("every:4", "bf16", "on")]


def _shardps_worker(args: tuple[list[str], int, int, tuple[int, ...], int, int, str, str, str, int, str]
                    ) -> list[float]:
    addresses, worker_id, workers, dims, batch_size, steps, sync, wire, overlap, threads, device = args
    import torch

    import shardps

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    dev = torch.device("cuda", worker_id % torch.cuda.device_count()) if cuda else torch.device("cpu")
    model = common.mlp(dims).to(dev)
    times = []
    with shardps.connect(addresses, worker_id=worker_id, num_workers=workers) as client:
        half = torch.bfloat16 if wire == "bf16" else None
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.01), sync=sync,
                                           grad_dtype=half, pull_dtype=half, overlap=overlap == "on")
        for step in range(steps):
            x, y = common.batch(step, worker_id, batch_size, dims)
            x, y = x.to(dev), y.to(dev)
            t0 = time.perf_counter()
            common.loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        opt.synchronize()
    return times


def run_shardps(dims: tuple[int, ...], servers: int, workers: int, batch_size: int, steps: int, sync: str,
                wire: str, overlap: str, threads: int, timeout: float, device: str = "cpu") -> list[list[float]]:
    import shardps

    ctx = multiprocessing.get_context("spawn")
    with shardps.LocalCluster(servers, processes=True) as cluster:
        with ctx.Pool(workers) as pool:
            res = pool.map_async(_shardps_worker, [(cluster.addresses, k, workers, dims, batch_size, steps, sync,
                                                    wire, overlap, threads, device) for k in range(workers)])
            return list(res.get(timeout))


def wire_mb(system: str, numel: int, workers: int, sync: str = "bsp", wire: str = "fp32") -> float:
    """Tensor payload one worker sends + receives per step, MB (10^6 bytes)."""
    if system == "ddp":
        return 2 * 2 * (workers - 1) / workers * numel * 4 / 1e6 if workers > 1 else 0.0
    if system == "ray-ps":
        return 2 * numel * 4 / 1e6
    per_sync = numel * (2 if wire == "bf16" else 4) * 2
    every = int(sync.split(":")[1]) if sync.startswith("every:") else 1
    return per_sync / every / 1e6


def _mean(times: list[list[float]], warmup: int) -> float:
    return statistics.fmean(t for per in times for t in per[warmup:])


class Runner:
    def __init__(self, args: argparse.Namespace, say: Any) -> None:
        self.args, self.say = args, say
        self._ray = False

    def ray(self) -> None:
        if not self._ray:
            import ray

            env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
            ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": env})
            self._ray = True

    def close(self) -> None:
        if self._ray:
            import ray

            ray.shutdown()

    def measure(self, system: str, dims: tuple[int, ...], servers: int, workers: int, sync: str = "bsp",
                wire: str = "fp32", overlap: str = "off") -> dict[str, Any]:
        a = self.args
        steps = a.warmup + a.steps
        t0 = time.perf_counter()
        if system == "ddp":
            from baselines import ddp

            times = ddp.run(dims, workers, a.batch, steps, a.threads, a.timeout, a.device)
        elif system == "ray-ps":
            from baselines import ray_ps

            self.ray()
            times = ray_ps.run(dims, workers, a.batch, steps, a.threads, a.timeout)
        else:
            times = run_shardps(dims, servers, workers, a.batch, steps, sync, wire, overlap, a.threads, a.timeout,
                                a.device)
        numel = common.numel(dims)
        row = {"system": system, "sync": sync if system == "shardps" else "", "wire": wire,
               "overlap": overlap if system == "shardps" else ("on" if system == "ddp" else "off"),
               "params": numel, "servers": servers if system == "shardps" else 0, "workers": workers,
               "step_ms": _mean(times, a.warmup) * 1e3, "wire_mb": wire_mb(system, numel, workers, sync, wire),
               "seconds": time.perf_counter() - t0}
        self.say(f"{system:8} {row['sync']:8} {wire:5} overlap {row['overlap']:3} {numel / 1e6:6.1f}M params, "
                 f"{servers} servers, "
                 f"{workers} workers: {row['step_ms']:8.1f} ms per step ({row['seconds']:.0f}s)")
        return row


def table(runner: Runner, dims: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every configuration ``--rounds`` times, each round in another order (a rotation), so that load on a
    shared machine hits all alike; a row's step time is the median of its rounds."""
    a = runner.args
    configs: list[tuple[str, int, str, str, str]] = [("ddp", 0, "bsp", "fp32", "off")]
    if "ray-ps" in a.systems and a.device == "cpu":
        configs.append(("ray-ps", 1, "bsp", "fp32", "off"))
    for sync, wire, overlap in SHARDPS_CONFIGS:
        if sync.split(":")[0] in a.systems or "shardps" in a.systems:
            configs.append(("shardps", a.servers, sync, wire, overlap))
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(configs))}
    for r in range(a.rounds):
        order = list(range(len(configs)))
        k = (r * len(configs)) // max(1, a.rounds)
        for i in order[k:] + order[:k]:
            system, servers, sync, wire, overlap = configs[i]
            runs[i].append(runner.measure(system, dims, servers, a.workers, sync, wire, overlap))
    rows = []
    for i in range(len(configs)):
        row = dict(runs[i][0])
        row["rounds_ms"] = [x["step_ms"] for x in runs[i]]
        row["step_ms"] = statistics.median(row["rounds_ms"])
        rows.append(row)
    ray_ps = next((r["step_ms"] for r in rows if r["system"] == "ray-ps"), None)
    ddp = rows[0]["step_ms"]
    for r in rows:
        r["x_ddp"] = r["step_ms"] / ddp
        r["ray_ps_x"] = ray_ps / r["step_ms"] if ray_ps else None  # Ray PS step / this step: > 1 is faster
    return rows


def sweep(runner: Runner, dims: tuple[int, ...]) -> list[dict[str, Any]]:
    a = runner.args
    points: list[tuple[str, int, int, tuple[int, ...]]] = []
    points += [("servers", s, a.workers, dims) for s in (1, 2, 4)]
    points += [("workers", a.servers, w, dims) for w in (1, 2, 4)]
    points += [("params", a.servers, a.workers, common.dims_for(p)) for p in (1e6, 10e6, 25e6, 100e6)]
    rows = []
    for axis, servers, workers, d in points:
        ddp = runner.measure("ddp", d, 0, workers)
        ps = runner.measure("shardps", d, servers, workers)
        rows.append({"axis": axis, "servers": servers, "workers": workers, "params": ps["params"],
                     "shardps_ms": ps["step_ms"], "ddp_ms": ddp["step_ms"], "x_ddp": ps["step_ms"] / ddp["step_ms"]})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'system':8} {'sync':8} {'wire':5} {'overlap':7} {'step ms':>9} {'x DDP':>6} {'RayPS/x':>7} "
          f"{'wire MB':>8}")
    for r in rows:
        rp = f"{r['ray_ps_x']:7.2f}" if r.get("ray_ps_x") else f"{'-':>7}"
        print(f"{r['system']:8} {r['sync']:8} {r['wire']:5} {r['overlap']:7} {r['step_ms']:9.1f} "
              f"{r['x_ddp']:6.2f} {rp} {r['wire_mb']:8.1f}")


def print_sweep(rows: list[dict[str, Any]]) -> None:
    print(f"{'varied':8} {'servers':>7} {'workers':>7} {'params':>8} {'shardps ms':>10} {'DDP ms':>8} {'x DDP':>6}")
    for r in rows:
        print(f"{r['axis']:8} {r['servers']:7d} {r['workers']:7d} {r['params'] / 1e6:7.1f}M {r['shardps_ms']:10.1f} "
              f"{r['ddp_ms']:8.1f} {r['x_ddp']:6.2f}")


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, axis, key in zip(axes, ("servers", "workers", "params"), ("servers", "workers", "params")):
        part = [r for r in rows if r["axis"] == axis]
        xs = [r[key] / 1e6 if key == "params" else r[key] for r in part]
        ax.plot(xs, [r["shardps_ms"] for r in part], "o-", label="shardps bsp")
        ax.plot(xs, [r["ddp_ms"] for r in part], "s--", label="DDP gloo")
        ax.set_xlabel("parameters (M)" if key == "params" else key)
        ax.set_ylabel("step ms")
        if key == "params":
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default=None, help="MLP widths, e.g. 2048,4096,4096,10 (the default)")
    p.add_argument("--params", type=float, default=None, help="instead of --dims: an MLP of about this many")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step (default 64)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2, help="shardps servers (default 2)")
    p.add_argument("--steps", type=int, default=12, help="timed steps (default 12; a multiple of 4)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers compute (cuda: DDP over NCCL, one GPU per worker, round robin)")
    p.add_argument("--systems", default="ddp,ray-ps,shardps",
                   help="comma-separated: ddp, ray-ps, shardps (all its modes) or bsp, asp, every")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, in rotating order; the median counts (default 1)")
    p.add_argument("--sweep", action="store_true", help="step time against servers, workers and model size")
    p.add_argument("--plot", metavar="PNG", default=None, help="with --sweep: draw the curves")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each system's run, seconds")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=3600.0)
    args = p.parse_args()
    args.systems = set(args.systems.split(","))
    dims = (tuple(int(x) for x in args.dims.split(",")) if args.dims
            else common.dims_for(args.params) if args.params else (2048, 4096, 4096, 10))
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"peers: MLP {'-'.join(map(str, dims))} ({common.numel(dims) / 1e6:.1f}M parameters), batch {args.batch} "
        f"per worker, {args.workers} workers x {args.threads} threads, {args.servers} shardps servers, "
        f"{args.steps} steps after {args.warmup}, on {os.cpu_count()} cores")
    runner = Runner(args, say)

    def go() -> dict[str, Any]:
        try:
            out: dict[str, Any] = {"dims": dims, "cores": os.cpu_count()}
            if args.sweep:
                out["sweep"] = sweep(runner, dims)
            else:
                out["table"] = table(runner, dims)
            return out
        finally:
            runner.close()

    out = run_guarded("peers", args.max_seconds, go, lambda: [])
    if out is None:
        return 1
    if "table" in out:
        print_table(out["table"])
    if "sweep" in out:
        print_sweep(out["sweep"])
        if args.plot:
            plot(args.plot, out["sweep"])
            say(f"plot saved to {args.plot}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
