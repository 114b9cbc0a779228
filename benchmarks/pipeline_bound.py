"""The fastest a pipeline of the char-GPT example can be on this machine: its compute alone, one process.

    .venv/bin/python benchmarks/pipeline_bound.py [--stages 2] [--chunks 4] [--recompute except_last]
        [--steps 20] [--cores 2] [--baseline TOKENS_PER_S] [--json]

The model, batch and cut of ``shardps ray --example shakespeare`` (width
128, 2 blocks, context 64, batch 64, the modules dealt evenly over the
stages), run by ``LocalPipeline``: every stage's tasks of the same plan
(schedule, micro-batches, recomputation) in this process, one torch thread
as each stage actor has, no servers and no hand-over. Each stage's tasks
are timed, so the step's work per stage, W_s, is measured, not assumed.

With one core per stage (stages <= cores) and nothing else to do, a GPipe
or 1F1B step cannot take less than max_s W_s x (m + d - 1) / m: the
slowest stage's work, stretched by the fill and drain of d stages over m
micro-batches. That is the bound printed, as a step time and in tokens per
second; ``--baseline`` prints what 3x a measured figure would need beside
it. The servers' step, the hand-over and Ray come on top of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shardps.examples.shakespeare import CharLoss, batch, load_text, make_model
from shardps.worker.pipeline.local import LocalPipeline


def timed(stage: Any, spent: list[float]) -> None:
    """Add the seconds of every forward and backward of ``stage`` (a StageRuntime) to ``spent[0]``."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return run
    stage.forward = wrap(stage.forward)
    stage.backward = wrap(stage.backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--schedule", default="gpipe")
    ap.add_argument("--recompute", default="except_last")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after 3 of warm-up")
    ap.add_argument("--cores", type=int, default=2, help="the cores the stages share (the bound needs stages <= cores)")
    ap.add_argument("--baseline", type=float, default=None, help="a measured tokens/s: print 3x it beside the bound")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.stages > args.cores:
        raise SystemExit(f"--stages {args.stages} > --cores {args.cores}: stages would share cores; the bound "
                         f"printed here assumes one core each")
    torch.set_num_threads(1)
    text = load_text()
    model = make_model(text.vocab, dim=128, layers=2, context=64, seed=0)
    n = len(model)
    balance = [n // args.stages + (1 if i < n % args.stages else 0) for i in range(args.stages)]
    pipe = LocalPipeline(model, balance=balance, chunks=args.chunks, schedule=args.schedule,
                         checkpoint=args.recompute, seed=0)
    spent = [[0.0] for _ in pipe.stages]
    for st, box in zip(pipe.stages, spent):
        timed(st, box)
    g = torch.Generator().manual_seed(0)
    loss_fn = CharLoss()
    steps: list[float] = []
    work: list[list[float]] = [[] for _ in pipe.stages]
    for i in range(3 + args.steps):
        x, y = batch(text.train, 64, 64, g)
        for box in spent:
            box[0] = 0.0
        t = time.perf_counter()
        pipe.train_step(x, y, loss_fn)
        if i >= 3:
            steps.append(time.perf_counter() - t)
            for w, box in zip(work, spent):
                w.append(box[0])
    tokens = 64 * 64
    one = statistics.median(steps)
    per_stage = [statistics.median(w) for w in work]
    d, m = args.stages, args.chunks
    bound_s = max(per_stage) * (m + d - 1) / m
    out: dict[str, Any] = {
        "stages": d, "chunks": m, "schedule": args.schedule, "recompute": args.recompute,
        "one_process_step_ms": round(one * 1e3, 1), "one_process_tokens_per_s": round(tokens / one),
        "stage_work_ms": [round(w * 1e3, 1) for w in per_stage],
        "pipeline_bound_step_ms": round(bound_s * 1e3, 1), "pipeline_bound_tokens_per_s": round(tokens / bound_s)}
    if args.baseline is not None:
        out["baseline_tokens_per_s"] = args.baseline
        out["three_x_baseline"] = round(3 * args.baseline)
        out["three_x_over_bound"] = round(3 * args.baseline * bound_s / tokens, 2)
    if args.json:
        print(json.dumps(out))
        return
    print(f"one process, all stages' tasks: {out['one_process_step_ms']} ms a step "
          f"({out['one_process_tokens_per_s']} tokens/s); each stage's work {out['stage_work_ms']} ms")
    print(f"bound for {d} stages on {d} cores, {m} micro-batches: {out['pipeline_bound_step_ms']} ms a step, "
          f"{out['pipeline_bound_tokens_per_s']} tokens/s")
    if args.baseline is not None:
        print(f"3x {args.baseline:g} tokens/s = {out['three_x_baseline']} tokens/s: "
              f"{out['three_x_over_bound']}x the bound")


if __name__ == "__main__":
    main()
