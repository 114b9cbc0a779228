"""Optimizer state held by the servers for a GPT-like model: Adam vs Adafactor vs SM3.

    .venv/bin/python benchmarks/optimizer_memory.py [--layers 12] [--d-model 768] [--vocab 50257]

Registers the model's parameters on 2 parameter servers (real gRPC, one
cluster per optimizer) and reads the optimizer state bytes back from the
servers' Stats, per tensor. Prints totals, the part held for matrices, and
the ratios to Adam. Matrices get the optimizer under test; vectors (biases,
norms) get it too, and are reported apart.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import shardps
from shardps import optim


def gpt_shapes(layers: int, d: int, vocab: int, ctx: int) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {"wte": (vocab, d), "wpe": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        s.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
                  p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
                  p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
                  p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                  p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
                  p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,)})
    s.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return s


def measure(spec: optim.OptimizerSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    tensors = {n: torch.zeros(s) for n, s in shapes.items()}
    with shardps.LocalCluster(2) as cluster, shardps.connect(cluster.addresses) as client:
        client.register(tensors, spec, sync="bsp")
        stats = client.stats()
    out = {"matrices": 0, "vectors": 0, "weights": 0}
    for s in stats:
        for t in s["tensors"]:
            out["matrices" if len(t["shape"]) >= 2 else "vectors"] += t["optimizer_state_bytes"]
            out["weights"] += t["weight_bytes"]
    out["total"] = out["matrices"] + out["vectors"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shapes = gpt_shapes(args.layers, args.d_model, args.vocab, args.ctx)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"GPT-like model: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}: "
          f"{n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB fp32) on 2 servers", flush=True)
    specs = {"adam": optim.Adam(), "adafactor": optim.Adafactor(), "sm3": optim.SM3()}
    results = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        results[name] = measure(spec, shapes)
        r = results[name]
        print(f"  {name:10s} state {r['total'] / 2**20:10.2f} MiB (matrices {r['matrices'] / 2**20:10.2f} MiB, "
              f"vectors {r['vectors'] / 2**20:6.2f} MiB)  [{time.perf_counter() - t0:.1f}s]", flush=True)
    adam = results["adam"]
    for name in ("adafactor", "sm3"):
        r = results[name]
        r["ratio_total"] = r["total"] / adam["total"]
        r["ratio_matrices"] = r["matrices"] / adam["matrices"]
        print(f"{name}: {100 * r['ratio_matrices']:.3f}% of Adam's state on the matrices, "
              f"{100 * r['ratio_total']:.3f}% in all (target <= 1% on the matrices)")
    if args.json:
        print(json.dumps({"params": n, **results}))


if __name__ == "__main__":
    main()
