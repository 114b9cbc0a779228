"""What running on Ray costs: server start-up and the per-step time of the same job, with and without Ray.

    .venv/bin/python benchmarks/ray_overhead.py [--steps 200] [--params 1e6] [--repeats 3] [--json]

In one run, on this machine: a local Ray cluster (``RayLocalCluster``, 4
logical CPUs) and, alternating, ``--repeats`` times each:

- start-up: ``shardps.ray.start_servers(2)`` (placement group, two actors
  serving) against ``LocalCluster(2, processes=True)`` (two ``shardps server``
  processes), wall time until every shard answers;
- training: 2 workers, bsp, an MLP of about ``--params`` parameters, Adam,
  ``--steps`` steps; the median step time inside the loop (after 10 warm-up
  steps), as worker actors of ``run_workers`` against the actor servers, and
  as worker processes against the process servers.

Prints medians and the ratios Ray / outside Ray. Absolute times drift on a
shared machine: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guard import run_guarded  # noqa: E402


def train_steps(addresses: list[str], worker_id: int, num_workers: int, steps: int, params: float,
                threads: int = 1) -> list[float]:
    """bsp training of an MLP; the wall time of each step (forward, backward, push, pull).

    ``threads``: torch threads of the worker, the same in both setups (Ray gives an actor of one CPU
    OMP_NUM_THREADS=1; a plain process would take every core and oversubscribe them). 0: leave torch's.
    """
    import torch
    from torch import nn

    import shardps

    if threads:
        torch.set_num_threads(threads)
    width = max(16, int((params / 2) ** 0.5))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 10))
    times = []
    with shardps.connect(addresses, worker_id=worker_id, num_workers=num_workers) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-3), sync="bsp")
        for step in range(steps):
            x = torch.randn(32, width, generator=torch.Generator().manual_seed(step * num_workers + worker_id))
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
    return times


def _process_worker(args: tuple[list[str], int, int, int, float, int]) -> list[float]:
    return train_steps(*args)


def ray_loop(ctx: Any) -> list[float]:
    c = ctx.config
    return train_steps(ctx.addresses, ctx.worker_id, ctx.num_workers, c["steps"], c["params"], c["threads"])


def measure(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    import ray

    import shardps
    import shardps.ray as sray

    out: dict[str, Any] = {"startup": {"ray": [], "processes": []}, "step": {"ray": [], "processes": []}}
    warm = 10
    t0 = time.perf_counter()
    with sray.RayLocalCluster(num_cpus=4) as rc:
        ray.init(address=rc.address, log_to_driver=False)
        out["cluster_seconds"] = time.perf_counter() - t0
        say(f"Ray cluster up in {out['cluster_seconds']:.1f}s")
        ctx = multiprocessing.get_context("spawn")
        try:
            for r in range(args.repeats):
                t = time.perf_counter()
                with sray.start_servers(2) as servers:
                    out["startup"]["ray"].append(time.perf_counter() - t)
                    times = sray.run_workers(ray_loop, servers, 2, config={"steps": args.steps, "params": args.params,
                                                                               "threads": args.threads})
                    out["step"]["ray"].append(statistics.median(times[0][warm:] + times[1][warm:]))
                t = time.perf_counter()
                with shardps.LocalCluster(2, processes=True) as cluster:
                    out["startup"]["processes"].append(time.perf_counter() - t)
                    with ctx.Pool(2) as pool:
                        times = pool.map(_process_worker, [(cluster.addresses, k, 2, args.steps, args.params,
                                                            args.threads)
                                                           for k in range(2)])
                    out["step"]["processes"].append(statistics.median(times[0][warm:] + times[1][warm:]))
                say(f"repeat {r + 1}: start-up {out['startup']['ray'][-1]:.2f}s on Ray vs "
                    f"{out['startup']['processes'][-1]:.2f}s as processes; step "
                    f"{out['step']['ray'][-1] * 1e3:.1f} ms vs {out['step']['processes'][-1] * 1e3:.1f} ms")
        finally:
            ray.shutdown()
    for kind in ("startup", "step"):
        med = {k: statistics.median(v) for k, v in out[kind].items()}
        out[kind + "_median"] = med
        out[kind + "_ratio"] = med["ray"] / med["processes"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--params", type=float, default=1e6, help="model parameters (about)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker in both setups (0: torch's default in each)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=1200.0)
    args = p.parse_args()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out = run_guarded("ray_overhead", args.max_seconds, lambda: measure(args, say), lambda: [])
    if out is None:
        return 130
    if args.json:
        print(json.dumps(out))
    else:
        s, st = out["startup_median"], out["step_median"]
        print(f"server start-up (2 shards): Ray {s['ray']:.2f}s, processes {s['processes']:.2f}s, "
              f"ratio {out['startup_ratio']:.2f}")
        print(f"bsp step (2 workers, {args.params:.0e} params): Ray {st['ray'] * 1e3:.1f} ms, processes "
              f"{st['processes'] * 1e3:.1f} ms, ratio {out['step_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
