"""The pipeline bubble, measured: idle share of each stage against (d-1)/(m+d-1), on Ray actors.

    .venv/bin/python benchmarks/pipeline_bubble.py [--stages 4] [--chunks 4 8 16] [--forward-ms 50]
        [--backward-ms 100] [--steps 3] [--timeline out.png] [--json]

Stages of equal synthetic cost: each stage's forward of a micro-batch sleeps
``--forward-ms`` and its backward ``--backward-ms`` (sleeping, so d stages
share two cores without competing), both schedules, no recomputation. For
each (schedule, m): the median over ``--steps`` steps of every stage's idle
share of the step (1 - its busy time / the step's span, from the stages'
own timelines), beside the formula; and the overhead per task (the step's
span minus the ideal (m + d - 1) (t_F + t_B), divided by the 2 (m + d - 1)
clocks): what handing a tensor from stage to stage (and the stage's own
loop) costs per task. ``--timeline``: a Gantt chart of the last step of each schedule at
the largest m (forward, backward, recompute, sync, idle).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from guard import run_guarded  # noqa: E402
from torch import nn  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:  # type: ignore[override]
        ctx.b = b
        time.sleep(f)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        time.sleep(ctx.b)
        return g, None, None


class FixedCost(nn.Module):
    """A layer whose forward takes ``f`` seconds and whose backward ``b`` (it sleeps)."""

    def __init__(self, f: float, b: float) -> None:
        super().__init__()
        self.f, self.b = f, b
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parameter comes first: every stage's backward (the first's too) goes through the sleep.
        return _Sleep.apply(x * self.scale, self.f, self.b)  # type: ignore[no-any-return]


def busy_share(timeline: dict[int, list[tuple[str, int, float, float]]]) -> tuple[list[float], float]:
    """Each stage's busy share of the step's span (F and B intervals; R lies inside B), and the span."""
    ivs = [iv for part in timeline.values() for iv in part if iv[0] in ("F", "B")]
    start, end = min(iv[2] for iv in ivs), max(iv[3] for iv in ivs)
    span = end - start
    return [sum(b - a for k, _, a, b in timeline[s] if k in ("F", "B")) / span for s in sorted(timeline)], span


def measure(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    import ray

    import shardps.ray as sray
    from shardps.worker.pipeline.schedule import bubble_fraction

    d, f, b = args.stages, args.forward_ms / 1e3, args.backward_ms / 1e3
    results: dict[str, Any] = {"stages": d, "forward_ms": args.forward_ms, "backward_ms": args.backward_ms,
                               "runs": []}
    timelines: dict[str, Any] = {}
    with sray.RayLocalCluster(num_cpus=max(4, d)) as rc:
        ray.init(address=rc.address, log_to_driver=False)
        try:
            for schedule in ("gpipe", "1f1b"):
                for m in args.chunks:
                    model = nn.Sequential(*[FixedCost(f, b) for _ in range(d)])
                    with sray.Pipeline(model, balance=[1] * d, chunks=m, schedule=schedule, checkpoint="never",
                                       num_cpus=0.25) as pipe:
                        x, y = torch.ones(m, 4), torch.zeros(m, 4)
                        pipe.train_step(x, y, nn.MSELoss())  # warm-up
                        idle, spans = [], []
                        for _ in range(args.steps):
                            pipe.train_step(x, y, nn.MSELoss())
                            tl = pipe.timeline()
                            busy, span = busy_share(tl)
                            idle.append([1 - s for s in busy])
                            spans.append(span)
                        per_stage = [statistics.median(i[s] for i in idle) for s in range(d)]
                        span = statistics.median(spans)
                        ideal = (m + d - 1) * (f + b)
                        row = {"schedule": schedule, "m": m, "idle_per_stage": [round(v, 4) for v in per_stage],
                               "idle_mean": round(statistics.mean(per_stage), 4),
                               "formula": round(bubble_fraction(m, d), 4), "step_s": round(span, 4),
                               "ideal_step_s": round(ideal, 4),
                               "overhead_per_task_ms": round((span - ideal) / (2 * (m + d - 1)) * 1e3, 2)}
                        results["runs"].append(row)
                        timelines[f"{schedule} m={m}"] = tl
                        say(f"{schedule:5} m={m:2}: idle {row['idle_mean']:.3f} (formula {row['formula']:.3f}), "
                            f"step {span * 1e3:.0f} ms (ideal {ideal * 1e3:.0f}), "
                            f"{row['overhead_per_task_ms']:.2f} ms per task")
        finally:
            ray.shutdown()
    if args.timeline:
        m = max(args.chunks)
        draw_timeline(args.timeline, {k: v for k, v in timelines.items() if k.endswith(f"m={m}")})
        say(f"timeline saved to {args.timeline}")
    return results


def draw_timeline(path: str, timelines: dict[str, dict[int, list[tuple[str, int, float, float]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "tab:blue", "B": "tab:orange", "R": "tab:green", "S": "tab:purple"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.2 + 0.6 * sum(len(t) for t in timelines.values())),
                             squeeze=False)
    for ax, (title, tl) in zip(axes[:, 0], timelines.items()):
        t0 = min(a for part in tl.values() for _, _, a, _ in part)
        for s, part in tl.items():
            for kind, mb, a, b in part:
                ax.broken_barh([(a - t0, b - a)], (s - 0.4, 0.8), facecolors=colours[kind])
                if kind in ("F", "B") and b - a > 0.01:
                    ax.text(a - t0 + (b - a) / 2, s, f"{kind}{mb}", ha="center", va="center", fontsize=7)
        ax.set_yticks(sorted(tl))
        ax.set_yticklabels([f"stage {s}" for s in sorted(tl)])
        ax.invert_yaxis()
        ax.set_xlabel("seconds (white: idle)")
        ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, ["forward", "backward", "recompute", "sync"], loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step (m)")
    p.add_argument("--forward-ms", type=float, default=50.0)
    p.add_argument("--backward-ms", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeline", default=None, metavar="PNG")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=900.0)
    args = p.parse_args()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out = run_guarded("pipeline_bubble", args.max_seconds, lambda: measure(args, say), lambda: [])
    if out is None:
        return 130
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'schedule':8} {'m':>3} {'idle (mean of stages)':>22} {'formula':>8} {'diff (points)':>14} "
              f"{'ms per task':>12}")
        for r in out["runs"]:
            print(f"{r['schedule']:8} {r['m']:>3} {r['idle_mean']:>22.3f} {r['formula']:>8.3f} "
                  f"{(r['idle_mean'] - r['formula']) * 100:>14.1f} {r['overhead_per_task_ms']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
