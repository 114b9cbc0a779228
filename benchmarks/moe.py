"""Mixture of experts on the servers: "pull" against "send" (bytes and step time), "auto", and training curves.

    .venv/bin/python benchmarks/moe.py placement --json          # the sweep below, 2 server processes
    .venv/bin/python benchmarks/moe.py curves --steps 600 --plot docs/img/moe_curves.png --json

``placement``: one ``shardps.nn.MoE`` layer (``--d-model`` 64, experts
``Linear(d, 4d)``, GELU, ``Linear(4d, d)``: 33,088 floats each, top-1,
dropless) on ``--shards`` server processes on loopback; for each number of
experts and tokens per step, three layers (pull, send, auto) take a step
each in turn (forward, backward, ``opt.step()``), ``--warmup`` rounds then
``--repeats`` timed; the median step time and payload bytes of each. The cost model: "pull" moves the rows of the
experts a batch hits and their gradients, 2 x U x (4P + 16) bytes with U =
E(1 - (1 - k/E)^T) expected; "send" moves the tokens out and back and, in
backward, the tokens and their output gradients out and the tokens'
gradients back, 5 x T x k x d x 4 bytes. Printed: the crossover (tokens
per step where "send" stops being the faster) the model predicts against
the one measured, and "auto"'s step time over the better placement's.

``curves``: examples/moe_gpt.py's char-GPT with ``--experts`` experts per
MLP (top-1) against the dense model with the same active parameters, the
same steps, batches and seed; validation loss every ``--eval-every`` steps,
both curves in one plot (``--plot``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import shardps
from shardps.optim import SGD

PLACEMENTS = ("pull", "send", "auto")


def expert(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def predicted_bytes(experts: int, tokens: int, k: int, d: int, params: int) -> dict[str, float]:
    hit = experts * (1 - (1 - k / experts) ** tokens)
    return {"pull": 2 * hit * (4 * params + 16), "send": 5 * tokens * k * d * 4}


def crossover(tokens: list[int], pull: list[float], send: list[float]) -> float | None:
    """The tokens per step (log-interpolated) where send - pull changes sign from below 0 to above; None if never."""
    for i in range(1, len(tokens)):
        a, b = send[i - 1] - pull[i - 1], send[i] - pull[i]
        if a < 0 <= b:
            f = -a / (b - a)
            return math.exp(math.log(tokens[i - 1]) + f * (math.log(tokens[i]) - math.log(tokens[i - 1])))
    return None


def point(addresses: list[str], experts: int, tokens: int, a: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per placement: the median step time and payload bytes over ``a.repeats`` rounds. A round is one step of
    each of three layers (pull, send, auto) in turn, so the three meet the same load; ``a.warmup`` rounds
    first (rows created, programs registered, "auto" trying both)."""
    torch.manual_seed(0)
    layers = {p: shardps.nn.MoE(a.d_model, experts, lambda: expert(a.d_model), name=f"e{experts}_t{tokens}_{p}",
                                drop_tokens=False, placement=p, optimizer=SGD(lr=0.01)) for p in PLACEMENTS}
    model = nn.ModuleDict({f"e{experts}_t{tokens}_{p}": m for p, m in layers.items()})  # gate names per point
    x = torch.randn(tokens, a.d_model)
    times: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
    sent: dict[str, list[int]] = {p: [] for p in PLACEMENTS}
    with shardps.connect(addresses, timeout=600) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.01), sync="asp")
        for i in range(a.warmup + a.repeats):
            for p, moe in layers.items():
                before = moe.stats.bytes_sent
                t0 = time.perf_counter()
                out, aux, _ = moe(x)
                (out.square().mean() + aux).backward()
                opt.step()
                opt.zero_grad()
                if i >= a.warmup:
                    times[p].append(time.perf_counter() - t0)
                    sent[p].append(moe.stats.bytes_sent - before)
    auto = layers["auto"].stats.placements
    return {p: {"seconds": statistics.median(times[p]), "bytes": statistics.median(sent[p]),
                "send_share": auto["send"] / max(1, sum(auto.values()))} for p in PLACEMENTS}


def placement_sweep(a: argparse.Namespace) -> dict[str, Any]:
    params = sum(p.numel() for p in expert(a.d_model).parameters())
    out: dict[str, Any] = {"d_model": a.d_model, "expert_params": params, "shards": a.shards, "points": [],
                           "crossover": []}
    cluster = shardps.LocalCluster(a.shards, processes=True).start()
    try:
        for e in a.experts:
            got = [point(cluster.addresses, e, t, a) for t in a.tokens]
            model = [predicted_bytes(e, t, 1, a.d_model, params) for t in a.tokens]
            measured = crossover(a.tokens, [g["pull"]["seconds"] for g in got], [g["send"]["seconds"] for g in got])
            predicted = crossover(a.tokens, [m["pull"] for m in model], [m["send"] for m in model])
            for t, g, m in zip(a.tokens, got, model):
                best = min(g["pull"]["seconds"], g["send"]["seconds"])
                out["points"].append({
                    "experts": e, "tokens": t, **{f"{p}_ms": round(1e3 * g[p]["seconds"], 2) for p in PLACEMENTS},
                    **{f"{p}_bytes": int(g[p]["bytes"]) for p in ("pull", "send")},
                    "model_pull_bytes": int(m["pull"]), "model_send_bytes": int(m["send"]),
                    "auto_send_share": round(g["auto"]["send_share"], 2),
                    "auto_over_best": round(g["auto"]["seconds"] / best, 3)})
            out["crossover"].append({
                "experts": e, "measured_tokens": None if measured is None else round(measured),
                "model_tokens": None if predicted is None else round(predicted),
                "ratio": None if measured is None or predicted is None else round(measured / predicted, 2)})
    finally:
        cluster.stop()
    return out


def curves(a: argparse.Namespace) -> dict[str, Any]:
    from shardps.examples.moe_gpt import run

    base = dict(steps=a.steps, eval_every=a.eval_every, dim=a.dim, layers=a.layers, context=a.context,
                top_k=1, placement="pull", capacity_factor=1.25, servers=a.shards, workers=1, lr=a.lr,
                batch_size=a.batch_size, seed=0, timeout=3600.0)
    moe = run(SimpleNamespace(**base, experts=a.moe_experts), lambda s: None)
    dense = run(SimpleNamespace(**base, experts=0), lambda s: None)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, r in ((f"MoE, {a.moe_experts} experts, top-1", moe), ("dense, same active parameters", dense)):
            ax.plot([s for s, _ in r["curve"]], [v for _, v in r["curve"]], marker="o", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.set_title(f"char-GPT on tinyshakespeare (dim {a.dim}, {a.layers} layers)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    keep = ("val_loss", "initial_val_loss", "curve", "seconds", "tokens_per_second", "dropped", "assignments")
    return {"moe": {k: moe[k] for k in keep}, "dense": {k: dense[k] for k in keep},
            "moe_minus_dense": round(moe["val_loss"] - dense["val_loss"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("placement")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (a step of each placement) per point")
    p.add_argument("--warmup", type=int, default=4, help="rounds before those (default 4)")
    c = sub.add_parser("curves")
    c.add_argument("--moe-experts", type=int, default=8)
    c.add_argument("--steps", type=int, default=600)
    c.add_argument("--eval-every", type=int, default=100)
    c.add_argument("--dim", type=int, default=64)
    c.add_argument("--layers", type=int, default=2)
    c.add_argument("--context", type=int, default=64)
    c.add_argument("--batch-size", type=int, default=32)
    c.add_argument("--lr", type=float, default=3e-3)
    c.add_argument("--plot", default=None, metavar="PNG")
    for q in (p, c):
        q.add_argument("--shards", type=int, default=2)
        q.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = placement_sweep(a) if a.what == "placement" else curves(a)
    if a.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
