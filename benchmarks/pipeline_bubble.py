"""The pipeline bubble, measured: idle share of each stage against (d-1)/(m+d-1), on Ray actors.

    .venv/bin/python benchmarks/pipeline_bubble.py [--stages 4] [--chunks 4 8 16] [--forward-ms 50]
        [--backward-ms 100] [--empty] [--steps 3] [--timeline out.png] [--json]

Stages of equal synthetic cost: each stage's forward of a micro-batch sleeps
``--forward-ms`` and its backward ``--backward-ms`` (sleeping, so d stages
share two cores without competing), both schedules, no recomputation. For
each (schedule, m): the median over ``--steps`` steps of every stage's idle
share of the step (1 - its busy time / the step's span, from the stages'
own timelines), beside the formula; and the overhead per task (the step's
span minus the ideal (m + d - 1) (t_F + t_B), divided by the 2 (m + d - 1)
clocks): what handing a tensor from stage to stage (and the stage's own
loop) costs per task, with whatever a sleep oversleeps counted in.
``--empty``: tasks of 0 ms, so that only the hand-over and the loop remain.

The phases, from each stage's own stamps (its link's calls, its run_step,
its timeline and its sleeps; ``phases_of_step``): per task, the wait in
recv, the sleep's overshoot of its nominal time, the stage's runtime around
the sleep (seeding, the functional call, autograd), the send call and the
walker's own time between them; per value a stage had to wait for, the
hand-over latency (its sender's send call to the end of its recv); per
step, the driver's call to stage 0's run_step, run_step's start to the first
task, the last task to run_step's end (flush, sync) and from there back to
the driver. ``--timeline``: a Gantt chart of the last step of each schedule
at the largest m (forward, backward, recompute, sync, idle).
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

import shardps.ray as sray  # noqa: E402
from shardps.deploy.ray.stage_actor import StageActor  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float, layer: FixedCost) -> torch.Tensor:  # type: ignore[override]
        ctx.b, ctx.layer = b, layer
        layer.sleep("F", f)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.layer.sleep("B", ctx.b)
        return g, None, None, None


class FixedCost(nn.Module):
    """A layer whose forward takes ``f`` seconds and whose backward ``b`` (it sleeps; 0: returns at once).
    ``slept``: how long each sleep took, (kind, seconds), in the order of the tasks."""

    def __init__(self, f: float, b: float) -> None:
        super().__init__()
        self.f, self.b = f, b
        self.scale = nn.Parameter(torch.ones(1))
        self.slept: list[tuple[str, float]] = []

    def sleep(self, kind: str, seconds: float) -> None:
        if seconds > 0:
            t0 = time.perf_counter()
            time.sleep(seconds)
            self.slept.append((kind, time.perf_counter() - t0))
        else:
            self.slept.append((kind, 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parameter comes first: every stage's backward (the first's too) goes through the sleep.
        return _Sleep.apply(x * self.scale, self.f, self.b, self)  # type: ignore[no-any-return]


class TimedLink:
    """A stage's link with every call stamped (wall-clock, as the stage's timeline) into ``events``:
    (call, kind, micro-batch, start, end); the walk sees it as the link itself."""

    def __init__(self, link: Any, events: list[tuple[str, str, int, float, float]]) -> None:
        self.link, self.events = link, events

    def _timed(self, call: str, kind: Any, mb: int, fn: Any, *args: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args)
        finally:
            self.events.append((call, str(kind), mb, t0, time.time()))

    def start(self, step: int, timeout: float, orders: Any = None) -> None:
        self._timed("start", "", -1, self.link.start, step, timeout, orders)

    def send(self, kind: Any, stage: int, mb: int, value: Any, /) -> None:
        self._timed("send", kind, mb, self.link.send, kind, stage, mb, value)

    def recv(self, kind: Any, stage: int, mb: int, /) -> Any:
        return self._timed("recv", kind, mb, self.link.recv, kind, stage, mb)

    def flush(self) -> None:
        self._timed("flush", "", -1, self.link.flush)

    def close(self) -> None:
        self.link.close()


class PhasedStage(StageActor):
    """A stage actor that keeps, for the last step, its link's stamps, its run_step's and its sleeps'."""

    events: list[tuple[str, str, int, float, float]] = []

    def _link(self) -> Any:
        return TimedLink(super()._link(), self.events)

    def _layers(self) -> list[FixedCost]:
        return [m for m in self.rt.module.modules() if isinstance(m, FixedCost)]

    def run_step(self, *args: Any) -> list[float]:
        self.events = []
        for layer in self._layers():
            layer.slept.clear()
        t0 = time.time()
        try:
            return super().run_step(*args)
        finally:
            self.events.append(("run", "", -1, t0, time.time()))

    def phases(self) -> dict[str, Any]:
        return {"events": self.events, "slept": [s for layer in self._layers() for s in layer.slept],
                "tasks": [(i.kind, i.microbatch, i.start, i.end) for i in self.rt.timeline if i.kind in ("F", "B")]}


class PhasedPipeline(sray.Pipeline):
    stage_actor = PhasedStage


def phases_of_step(stages: list[dict[str, Any]], t_call: float, t_return: float, f: float,
                   b: float) -> dict[str, list[float]]:
    """One step's phases in ms, from each stage's own stamps: per task (every stage) the wait in recv, the
    sleep's overshoot of its nominal time, the stage's time around the sleep (the runtime's forward or
    backward less the sleep), the send, and the walker's time between (the rest of the task's wall time);
    per value a stage waited for, the hand-over latency (its sender's send call to the end of its recv);
    per step the driver's and the stages' time before the first task and after the last."""
    out: dict[str, list[float]] = {k: [] for k in ("recv", "overshoot", "runtime", "send", "walker", "latency",
                                                   "call", "begin", "end", "return")}
    sends = {(s, k, mb): (a, z) for s, st in enumerate(stages) for c, k, mb, a, z in st["events"] if c == "send"}
    last = len(stages) - 1
    for s, st in enumerate(stages):
        ev = {(c, k, mb): (a, z) for c, k, mb, a, z in st["events"]}
        slept = {k: iter([d for kk, d in st["slept"] if kk == k]) for k in ("F", "B")}
        prev = ev[("start", "", -1)][1]
        for kind, mb, a, z in sorted(st["tasks"], key=lambda t: t[2]):
            r, sd = ev.get(("recv", kind, mb)), ev.get(("send", kind, mb))
            recv, send = (r[1] - r[0] if r else 0.0), (sd[1] - sd[0] if sd else 0.0)
            sl = next(slept[kind], 0.0)
            out["recv"].append(recv * 1e3)
            out["overshoot"].append((sl - (f if kind == "F" else b)) * 1e3)
            out["runtime"].append((z - a - sl) * 1e3)
            out["send"].append(send * 1e3)
            this_end = sd[1] if sd else z
            out["walker"].append((this_end - prev - recv - (z - a) - send) * 1e3)
            prev = this_end
            peer = s - 1 if kind == "F" else s + 1
            if r and 0 <= peer <= last and (peer, kind, mb) in sends and r[0] < sends[(peer, kind, mb)][0]:
                out["latency"].append((r[1] - sends[(peer, kind, mb)][0]) * 1e3)
    run0 = stages[0]["events"][-1]
    first = min(t[2] for t in stages[0]["tasks"])
    out["call"].append((run0[3] - t_call) * 1e3)
    out["begin"].append((first - run0[3]) * 1e3)
    s_end = max(range(len(stages)), key=lambda s: stages[s]["events"][-1][4])
    run_end = stages[s_end]["events"][-1][4]
    out["end"].append((run_end - max(t[3] for t in stages[s_end]["tasks"])) * 1e3)
    out["return"].append((t_return - run_end) * 1e3)
    return out


def summarise(per_step: list[dict[str, list[float]]]) -> dict[str, float]:
    """Means over every task (or value, or step) of every step, in ms; the latency's median too."""
    pooled = {k: [v for p in per_step for v in p[k]] for k in per_step[0]}
    out = {k: round(statistics.mean(v), 3) if v else float("nan") for k, v in pooled.items()}
    out["latency_median"] = round(statistics.median(pooled["latency"]), 3) if pooled["latency"] else float("nan")
    out["latency_n"] = len(pooled["latency"])
    return out


PHASES = (("recv", "recv wait"), ("overshoot", "sleep overshoot"), ("runtime", "stage runtime"),
          ("send", "send"), ("walker", "walker"), ("latency", "hand-over latency"),
          ("latency_median", "(median)"), ("call", "driver -> stage 0"), ("begin", "run_step -> first task"),
          ("end", "last task -> run_step end"), ("return", "-> driver"))


def phase_line(ph: dict[str, float]) -> str:
    return (f"per task (mean ms): recv wait {ph['recv']:.2f}, sleep overshoot {ph['overshoot']:.2f}, "
            f"stage runtime {ph['runtime']:.2f}, send {ph['send']:.2f}, walker {ph['walker']:.2f}; "
            f"hand-over latency {ph['latency']:.2f} (median {ph['latency_median']:.2f}, {ph['latency_n']} waits); "
            f"per step: driver -> stage 0 {ph['call']:.1f}, run_step -> first task {ph['begin']:.1f}, "
            f"last task -> run_step end {ph['end']:.1f}, -> driver {ph['return']:.1f}")


def busy_share(timeline: dict[int, list[tuple[str, int, float, float]]]) -> tuple[list[float], float]:
    """Each stage's busy share of the step's span (F and B intervals; R lies inside B), and the span."""
    ivs = [iv for part in timeline.values() for iv in part if iv[0] in ("F", "B")]
    start, end = min(iv[2] for iv in ivs), max(iv[3] for iv in ivs)
    span = end - start
    return [sum(b - a for k, _, a, b in timeline[s] if k in ("F", "B")) / span for s in sorted(timeline)], span


def measure(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    import ray

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
                    with PhasedPipeline(model, balance=[1] * d, chunks=m, schedule=schedule, checkpoint="never",
                                        num_cpus=0.25) as pipe:
                        x, y = torch.ones(m, 4), torch.zeros(m, 4)
                        pipe.train_step(x, y, nn.MSELoss())  # warm-up
                        idle, spans, phases = [], [], []
                        for _ in range(args.steps):
                            t_call = time.time()
                            pipe.train_step(x, y, nn.MSELoss())
                            t_return = time.time()
                            tl = pipe.timeline()
                            busy, span = busy_share(tl)
                            idle.append([1 - s for s in busy])
                            spans.append(span)
                            stages = ray.get([a.phases.remote() for a in pipe.stages[0]], timeout=120)
                            phases.append(phases_of_step(stages, t_call, t_return, f, b))
                        per_stage = [statistics.median(i[s] for i in idle) for s in range(d)]
                        span = statistics.median(spans)
                        ideal = (m + d - 1) * (f + b)
                        row = {"schedule": schedule, "m": m, "idle_per_stage": [round(v, 4) for v in per_stage],
                               "idle_mean": round(statistics.mean(per_stage), 4),
                               "formula": round(bubble_fraction(m, d), 4), "step_s": round(span, 4),
                               "ideal_step_s": round(ideal, 4),
                               "overhead_per_task_ms": round((span - ideal) / (2 * (m + d - 1)) * 1e3, 2),
                               "phases_ms": summarise(phases)}
                        # The same less what the sleeps overslept (a task's mean): the loop's and the hand-over's own.
                        row["overhead_less_overshoot_ms"] = round(row["overhead_per_task_ms"] -
                                                                  row["phases_ms"]["overshoot"], 2)
                        results["runs"].append(row)
                        timelines[f"{schedule} m={m}"] = tl
                        say(f"{schedule:5} m={m:2}: idle {row['idle_mean']:.3f} (formula {row['formula']:.3f}), "
                            f"step {span * 1e3:.0f} ms (ideal {ideal * 1e3:.0f}), "
                            f"{row['overhead_per_task_ms']:.2f} ms per task "
                            f"({row['overhead_less_overshoot_ms']:.2f} less the sleeps' overshoot)")
                        say("       " + phase_line(row["phases_ms"]))
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
    p.add_argument("--empty", action="store_true", help="tasks of 0 ms (--forward-ms 0 --backward-ms 0): "
                   "what the hand-over and the stage loop cost alone")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeline", default=None, metavar="PNG")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=900.0)
    args = p.parse_args()
    if args.empty:
        args.forward_ms = args.backward_ms = 0.0
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out = run_guarded("pipeline_bubble", args.max_seconds, lambda: measure(args, say), lambda: [])
    if out is None:
        return 130
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'schedule':8} {'m':>3} {'idle (mean of stages)':>22} {'formula':>8} {'diff (points)':>14} "
              f"{'ms per task':>12} {'less overshoot':>15}")
        for r in out["runs"]:
            print(f"{r['schedule']:8} {r['m']:>3} {r['idle_mean']:>22.3f} {r['formula']:>8.3f} "
                  f"{(r['idle_mean'] - r['formula']) * 100:>14.1f} {r['overhead_per_task_ms']:>12.2f} "
                  f"{r['overhead_less_overshoot_ms']:>15.2f}")
        print("\nphases, ms (per task: mean over every task of every stage; per step: mean over the steps)")
        print(f"{'schedule':8} {'m':>3} " + " ".join(f"{label:>{max(8, len(label))}}" for _, label in PHASES))
        for r in out["runs"]:
            print(f"{r['schedule']:8} {r['m']:>3} " + " ".join(
                f"{r['phases_ms'][k]:>{max(8, len(label))}.2f}" for k, label in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
