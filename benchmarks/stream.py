#!/usr/bin/env python
"""Streamed weights (``DistributedOptimizer(stream=shardps.Stream(...))``): memory and step time, in one run.

    .venv/bin/python benchmarks/stream.py [--part all|gpt|peers|curve] [--plot docs/img/stream-curve.png] [--json]

- ``gpt``: the tinyshakespeare GPT (``--dim`` 512, ``--layers`` 8: 25M
  parameters, 101 MB) trained by one worker with ``max_live_bytes`` =
  ``--gpt-budget`` of the model (0.06): the loss before and after, the peak
  live parameter + gradient bytes over the model's, the process's RSS growth.
- ``peers``: benchmarks/peers.py's workload (MLP 2048-4096-4096-10, 25.2M
  parameters, batch 64, SGD, bsp, fp32, one worker, ``--servers`` server
  processes), resident and streamed under each ``--peers-budget`` (fractions
  of the model: 0.5 and 1.0), in rounds of rotating order; the step time
  ratio resident / streamed (1: streaming is free).
- ``memory``: the worker's peak RSS, resident against streamed with a budget of ``--memory-budget`` of
  the model (a sixth), each run a fresh process (``python -m shardps.examples.gpt_stream``: the allocator's
  state is per process), ``--rounds`` times in alternating order, the GPT of ``--dim`` / ``--layers``,
  ``--memory-steps`` steps. Printed: each run's peak RSS growth and peak live bytes, and the target's
  check: streamed peak below resident's by at least half of what streaming frees (2 x model - budget).
- ``curve``: the GPT of ``--curve-dim`` / ``--curve-layers`` for budgets from
  0 (one unit at a time) to the whole model: peak live bytes and step time
  against the budget, resident beside; ``--plot PNG`` draws it.

Servers are processes (``LocalCluster(processes=True)``); the worker is
this process. Absolute times drift on a shared machine: compare the ratios
of one run, and say the load (``uptime``) beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import common  # noqa: E402

PEERS_DIMS = (2048, 4096, 4096, 10)


def memory(a: argparse.Namespace, say: Any) -> dict[str, Any]:
    import subprocess

    from shardps.examples.shakespeare import load_text, make_model

    model_bytes = sum(p.numel() * 4 for p in make_model(load_text().vocab, dim=a.dim, layers=a.layers).parameters())
    budget_mb = a.memory_budget * model_bytes / 2**20

    def run(resident: bool) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "shardps.examples.gpt_stream", "--json", "--dim", str(a.dim), "--layers",
               str(a.layers), "--heads", str(a.heads), "--context", str(a.context), "--batch-size",
               str(a.batch_size), "--steps", str(a.memory_steps), "--servers", str(a.servers), "--log-every", "1000"]
        cmd += ["--resident"] if resident else ["--max-live-mb", f"{budget_mb:.3f}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return {k: out[k] for k in ("peak_rss_growth_bytes", "rss_growth_bytes", "peak_live_bytes",
                                    "mean_step_seconds")}

    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        row = {}
        for resident in ((True, False) if r % 2 == 0 else (False, True)):
            row["resident" if resident else "streamed"] = run(resident)
        rounds.append(row)
        say(f"memory round {r + 1}: {row}")
    res = statistics.median(x["resident"]["peak_rss_growth_bytes"] for x in rounds)
    stm = statistics.median(x["streamed"]["peak_rss_growth_bytes"] for x in rounds)
    freed = 2 * model_bytes - a.memory_budget * model_bytes
    return {"model_bytes": model_bytes, "budget_bytes": int(a.memory_budget * model_bytes), "rounds": rounds,
            "resident_peak_rss_growth_bytes": res, "streamed_peak_rss_growth_bytes": stm,
            "lower_by_bytes": res - stm, "target_bytes": int(freed / 2), "target_met": res - stm >= freed / 2}


def quiet(_: str) -> None:
    pass


def gpt(a: argparse.Namespace, say: Any) -> dict[str, Any]:
    import shardps
    from shardps.examples.gpt_stream import train
    from shardps.examples.shakespeare import load_text, make_model

    model_bytes = sum(p.numel() * 4 for p in make_model(load_text().vocab, dim=a.dim, layers=a.layers).parameters())
    budget = int(a.gpt_budget * model_bytes)
    with shardps.LocalCluster(a.servers, processes=True) as cluster:
        out = train(cluster.addresses, dim=a.dim, layers=a.layers, heads=a.heads, context=a.context,
                    batch_size=a.batch_size, steps=a.gpt_steps, max_live_bytes=budget, log_every=10, say=say,
                    lr=a.gpt_lr)
    times = out.pop("step_seconds")
    out["mean_step_seconds"] = round(statistics.mean(times[1:]), 3)
    return out


def _peers_steps(addresses: list[str], budget: int | None, steps: int, seed_step: int) -> tuple[list[float], float]:
    """Each timed step's seconds, and the seconds per step forward and backward waited for pulls."""
    import torch

    import shardps

    model = common.mlp(PEERS_DIMS)
    stream = shardps.Stream(budget) if budget is not None else None
    times = []
    waited = 0.0
    with shardps.connect(addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.01), stream=stream)
        for step in range(steps + 1):  # the first: registering, recording the plan
            if step == 1 and opt.stream is not None:
                opt.stream.wait_seconds = 0.0
            x, y = common.batch(seed_step + step, 0, 64, PEERS_DIMS)
            t0 = time.perf_counter()
            common.loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step:
                times.append(time.perf_counter() - t0)
        if opt.stream is not None:
            waited = opt.stream.wait_seconds / steps
            opt.stream.close()
    del torch
    return times, waited


def peers(a: argparse.Namespace, say: Any) -> dict[str, Any]:
    import shardps

    model_bytes = common.numel(PEERS_DIMS) * 4
    budgets = {f"streamed@{f:g}": int(f * model_bytes) for f in a.peers_budget}
    kinds = ["resident", *budgets]
    got: dict[str, list[float]] = {k: [] for k in kinds}
    waits: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(a.rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # each round in another order
            with shardps.LocalCluster(a.servers, processes=True) as cluster:
                t, w = _peers_steps(cluster.addresses, budgets.get(kind), a.peers_steps, 100 * r)
            got[kind].append(statistics.median(t))
            waits[kind].append(w)
            say(f"peers round {r}: {kind} {got[kind][-1]:.3f} s/step")
    res = statistics.median(got["resident"])
    out: dict[str, Any] = {"params": common.numel(PEERS_DIMS), "resident_step_s": round(res, 4)}
    for kind, budget in budgets.items():
        st = statistics.median(got[kind])
        out[kind] = {"max_live_bytes": budget, "step_s": round(st, 4),
                     "ratio_resident_over_streamed": round(res / st, 3),
                     "pull_wait_s_per_step": round(statistics.median(waits[kind]), 4)}
    out["rounds"] = got
    return out


def curve(a: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    import shardps
    from shardps.examples.gpt_stream import train

    rows = []
    points: list[float | None] = [0.0, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0, None]
    model_bytes = 0
    for frac in points:
        with shardps.LocalCluster(a.servers, processes=True) as cluster:
            if not model_bytes:
                from shardps.examples.shakespeare import load_text, make_model

                m = make_model(load_text().vocab, dim=a.curve_dim, layers=a.curve_layers)
                model_bytes = sum(p.numel() * 4 for p in m.parameters())
            budget = None if frac is None else int(frac * model_bytes)
            out = train(cluster.addresses, dim=a.curve_dim, layers=a.curve_layers, heads=a.heads,
                        context=a.context, batch_size=a.batch_size, steps=a.curve_steps, max_live_bytes=budget,
                        log_every=10**9, say=quiet)
        row = {"budget_fraction": frac, "max_live_bytes": budget, "peak_over_model": out["peak_over_model"],
               "step_s": round(statistics.median(out["step_seconds"][1:]), 4), "pulls_per_step": out["pulls_per_step"],
               "pull_wait_s_per_step": out["pull_wait_s_per_step"]}
        say(f"curve: {row}")
        rows.append(row)
    return rows


def plot(path: str, rows: list[dict[str, Any]], load: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streamed = [r for r in rows if r["budget_fraction"] is not None]
    resident = [r for r in rows if r["budget_fraction"] is None][0]
    xs = [r["budget_fraction"] for r in streamed]
    fig, ax1 = plt.subplots(figsize=(6.4, 4))
    ax1.plot(xs, [r["peak_over_model"] for r in streamed], "o-", color="tab:blue", label="peak live / model")
    ax1.plot(xs, xs, ":", color="tab:blue", alpha=0.5, label="budget / model")
    ax1.set_xlabel("max_live_bytes / model bytes")
    ax1.set_ylabel("peak live parameter + gradient bytes / model", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xs, [resident["step_s"] / r["step_s"] for r in streamed], "s-", color="tab:red",
             label="resident step / streamed step")
    ax2.set_ylabel("step time ratio resident / streamed", color="tab:red")
    ax2.set_ylim(0, 1.2)
    ax1.set_title(f"Streamed GPT, one worker, 2 servers (load {load})", fontsize=9)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.9), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "gpt", "peers", "curve", "memory"], default="all")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--gpt-steps", type=int, default=40)
    p.add_argument("--gpt-budget", type=float, default=0.06)
    p.add_argument("--memory-budget", type=float, default=1 / 6, help="--part memory: the budget, of the model")
    p.add_argument("--memory-steps", type=int, default=5)
    p.add_argument("--gpt-lr", type=float, default=3e-3, help="the servers' Adam learning rate for --part gpt")
    p.add_argument("--peers-budget", type=float, nargs="+", default=[0.5, 1.0],
                   help="budgets (fractions of the model) to stream the peers workload under")
    p.add_argument("--peers-steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--curve-dim", type=int, default=256)
    p.add_argument("--curve-layers", type=int, default=4)
    p.add_argument("--curve-steps", type=int, default=8)
    p.add_argument("--plot", help="write the curve's plot here (PNG)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    load = os.getloadavg()
    out: dict[str, Any] = {"load_before": [round(x, 2) for x in load]}
    if a.part in ("all", "gpt"):
        out["gpt"] = gpt(a, say)
        say(f"gpt: {out['gpt']}")
    if a.part in ("all", "memory"):
        out["memory"] = memory(a, say)
        m, mb = out["memory"], 2**20
        say(f"memory: peak RSS growth resident {m['resident_peak_rss_growth_bytes'] / mb:.0f} MiB, streamed "
            f"{m['streamed_peak_rss_growth_bytes'] / mb:.0f} MiB (budget {m['budget_bytes'] / mb:.1f} MiB): lower by "
            f"{m['lower_by_bytes'] / mb:.0f} MiB, target {m['target_bytes'] / mb:.0f} MiB: "
            f"{'met' if m['target_met'] else 'NOT met'}")
    if a.part in ("all", "peers"):
        out["peers"] = peers(a, say)
        say(f"peers: { {k: v for k, v in out['peers'].items() if k != 'rounds'} }")  # noqa: E201,E202
    if a.part in ("all", "curve"):
        out["curve"] = curve(a, say)
        if a.plot:
            plot(a.plot, out["curve"], f"{load[0]:.1f}")
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
