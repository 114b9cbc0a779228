"""What activation offload saves and costs: saved-activation bytes held by each stage, bytes stored, step time.

    .venv/bin/python benchmarks/pipeline_offload.py [--width 2048] [--batch 256] [--chunks 4] [--steps 5]
        [--rounds 3] [--json]

One run, on a local Ray cluster of two nodes (the second offers the
``offload`` resource, so the store lands there): a 2-stage MLP whose blocks
are Linear -> ReLU -> Dropout (the ReLU's output feeds only its own backward),
``checkpoint="never"``, 1F1B, four configurations in turn: offload off, on,
on with the lossless 1-bit ReLU masks, on with bf16 + masks. Per
configuration: the largest number of bytes of saved activations a stage
held at once (peak over the step, the worse stage), the bytes sent to the
store per step, the median step time, and the largest relative gradient
error against offload off (0 for the lossless ones). The configurations run
in turn ``--rounds`` times (off, on, ..., off, on, ...): each one's figures
are those of its median round, its ratio against off's median round.
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

CONFIGS = {"off": {}, "on": {"offload": "activations"},
           "on + relu-mask": {"offload": "activations", "compress": "relu-mask"},
           "on + bf16 + relu-mask": {"offload": "activations", "compress": ("bf16", "relu-mask")}}


def model(width: int, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, width)]
    layers += [nn.ReLU(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def measure(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    import ray

    import shardps.ray as sray

    m = model(args.width)
    n = len(m)
    balance = [n // 2, n - n // 2]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    out: dict[str, Any] = {"width": args.width, "batch": args.batch, "chunks": args.chunks, "configs": {}}
    ref_grads: dict[str, torch.Tensor] = {}
    with sray.RayLocalCluster(num_cpus=2) as rc:
        rc.add_node(num_cpus=2, resources={"offload": 1})
        ray.init(address=rc.address, log_to_driver=False)
        try:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
            for r in range(args.rounds):  # the configurations in turn, round after round: the load's drift
                for name, kw in CONFIGS.items():  # falls on all of them
                    with sray.Pipeline(m, balance=balance, chunks=args.chunks, schedule="1f1b",
                                       checkpoint="never", seed=1, **kw) as pipe:
                        pipe.train_step(x, y, nn.CrossEntropyLoss())  # warm-up
                        times = []
                        for _ in range(args.steps):
                            t0 = time.perf_counter()
                            pipe.train_step(x, y, nn.CrossEntropyLoss())
                            times.append(time.perf_counter() - t0)
                        stats = pipe.offload_stats()
                        grads = pipe.gradients()
                    if not ref_grads:
                        ref_grads = grads
                    err = max(float((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm().clamp_min(1e-30))
                              for k in ref_grads)
                    row = {"peak_held_bytes": max(s["peak_held_bytes"] for s in stats.values()),
                           "stored_bytes_per_step": sum(s["stored_total"] for s in stats.values()),
                           "raw_bytes_per_step": sum(s["raw_total"] for s in stats.values()),
                           "step_s": statistics.median(times), "max_rel_grad_error": err}
                    runs[name].append(row)
                    say(f"round {r + 1}/{args.rounds} {name:22} held {row['peak_held_bytes'] / 2**20:7.2f} MiB, "
                        f"stored {row['stored_bytes_per_step'] / 2**20:7.2f} MiB/step, step "
                        f"{row['step_s'] * 1e3:6.1f} ms, grad error {err:.1e}")
            for name, rows in runs.items():  # each configuration's median round; every round's step kept
                row = dict(sorted(rows, key=lambda x: x["step_s"])[len(rows) // 2])
                row["max_rel_grad_error"] = max(x["max_rel_grad_error"] for x in rows)
                row["round_step_s"] = [x["step_s"] for x in rows]
                out["configs"][name] = row
        finally:
            ray.shutdown()
    base = out["configs"]["off"]
    for row in out["configs"].values():
        row["held_ratio"] = row["peak_held_bytes"] / base["peak_held_bytes"]
        row["step_ratio"] = row["step_s"] / base["step_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="each configuration this many times, in turn")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=900.0)
    args = p.parse_args()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out = run_guarded("pipeline_offload", args.max_seconds, lambda: measure(args, say), lambda: [])
    if out is None:
        return 130
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'offload':22} {'held MiB':>9} {'x off':>6} {'stored MiB/step':>16} {'step ms':>8} {'x off':>6} "
              f"{'grad error':>11}")
        for name, r in out["configs"].items():
            print(f"{name:22} {r['peak_held_bytes'] / 2**20:>9.2f} {r['held_ratio']:>6.2f} "
                  f"{r['stored_bytes_per_step'] / 2**20:>16.2f} {r['step_s'] * 1e3:>8.1f} {r['step_ratio']:>6.2f} "
                  f"{r['max_rel_grad_error']:>11.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
