"""Mixture of experts on the servers: "pull" against "send" (bytes and step time), "auto", and training curves.

    .venv/bin/python benchmarks/moe.py costs --json              # the cost model's constants on this machine
    .venv/bin/python benchmarks/moe.py placement --json          # the sweep below, 2 server processes
    .venv/bin/python benchmarks/moe.py placement --calibrate --json   # the same, the constants measured first
    .venv/bin/python benchmarks/moe.py placement --calibrate --link 200mbit --json   # on shaped links (root)
    .venv/bin/python benchmarks/moe.py curves --steps 600 --plot docs/img/moe_curves.png --json

``placement``: one ``shardps.nn.MoE`` layer (``--d-model`` 64, experts
``Linear(d, 4d)``, GELU, ``Linear(4d, d)``: 33,088 floats each, top-1,
dropless) on ``--shards`` server processes on loopback; for each number of
experts and tokens per step, three layers (pull, send, auto) take a step
each in turn (forward, backward, ``opt.step()``), ``--warmup`` rounds then
``--repeats`` timed; the median step time and payload bytes of each. The bytes: "pull" moves
the rows of the experts a batch hits and their gradients, 2 x U x (4P + 16)
bytes with U = E(1 - (1 - k/E)^T) expected; "send" moves the tokens out and
back and, in backward, the tokens and their output gradients out and the
tokens' gradients back, 5 x T x k x d x 4 bytes. The step time the cost
model predicts (worker/experts/placement.py, ``CostModel``: the layer's own,
``--cost-model`` the JSON ``costs`` printed, or ``--calibrate``: measured
as ``costs`` does, in the same run, just before the sweep) for the same
expected U.
Printed: the crossover (tokens per step where "send" stops being the
faster) the cost model predicts and the bytes alone would, against the one
measured, and "auto"'s step time over the better placement's: the ratio of
their medians (``auto_over_best``) and the median over rounds of auto's step
over the better one's in the same round (``auto_over_best_paired``: the two
steps a few ms apart, so a slower stretch of the machine slows both).

``--link RATE`` (placement, costs): the same on a simulated cluster
(``shardps.netsim``; needs root): the ``--shards`` servers on hosts of
their own, the layers on another, every host's link shaped at RATE in both
directions, so that bytes cost what they cost on such a network.
``--addresses``: servers that are already running.

``costs``: the cost model's constants measured on this machine: the link's
seconds per byte (a pull and push of ``--experts`` expert rows against 1),
and for each placement one layer's step at (1 expert, ``--few`` tokens), (1
expert, ``--many`` tokens), (``--mid-experts``, ``--many``) and
(``--experts`` experts, ``--many`` tokens): the slope over tokens is the
per-flop cost (here for pull, on the shards for send, less the tokens'
bytes), the steps of more experts over 1 the cost per expert, a constant
and a part that grows with the experts (``a (U - 1) + b (U^2 - 1)`` through
both; less the rows' bytes for pull), the rest the fixed cost per step.

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
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import shardps
from shardps.optim import SGD
from shardps.worker.experts.placement import CostModel

PLACEMENTS = ("pull", "send", "auto")


def expert(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def expected_hit(experts: int, tokens: int, k: int) -> float:
    """The expected distinct experts of ``tokens`` tokens routed uniformly to ``k`` of ``experts`` each."""
    return experts * (1 - (1 - k / experts) ** tokens)


def predicted_bytes(experts: int, tokens: int, k: int, d: int, params: int) -> dict[str, float]:
    return {"pull": 2 * expected_hit(experts, tokens, k) * (4 * params + 16), "send": 5 * tokens * k * d * 4}


def predicted_seconds(model: CostModel, experts: int, tokens: int, k: int, d: int, params: int) -> dict[str, float]:
    return model.seconds(experts=expected_hit(experts, tokens, k), assignments=tokens * k, params=params, d_model=d)


FINE = sorted({round(10 ** (i / 100)) for i in range(0, 601)})  # 1 to 1,000,000 tokens: where a model crosses


def crossover(tokens: list[int], pull: list[float], send: list[float]) -> float | None:
    """The tokens per step (log-interpolated) where send - pull changes sign from below 0 to above for the last
    time (past it pull stays the faster; at few tokens the two can be level within the noise and cross back and
    forth); None if never."""
    for i in reversed(range(1, len(tokens))):
        a, b = send[i - 1] - pull[i - 1], send[i] - pull[i]
        if a < 0 <= b:
            f = -a / (b - a)
            return math.exp(math.log(tokens[i - 1]) + f * (math.log(tokens[i]) - math.log(tokens[i - 1])))
    return None


Spec = tuple[int, int, str]  # (experts, tokens per step, placement) of one layer


def steps(addresses: list[str], specs: list[Spec], a: argparse.Namespace,
          cost_model: CostModel | None = None) -> dict[Spec, dict[str, float]]:
    """Per layer: the median step time and payload bytes over ``a.repeats`` rounds. A round is one step of
    each layer in turn, so they meet the same load, each round starting one layer further on (none always
    follows the same one); ``a.warmup`` rounds first (rows created, programs registered, "auto"'s probes)."""
    torch.manual_seed(0)
    layers = {(e, t, p): shardps.nn.MoE(a.d_model, e, lambda: expert(a.d_model), name=f"e{e}_t{t}_{p}",
                                        drop_tokens=False, placement=p, optimizer=SGD(lr=0.01),
                                        cost_model=cost_model) for e, t, p in specs}
    model = nn.ModuleDict({f"e{e}_t{t}_{p}": m for (e, t, p), m in layers.items()})  # gate names per layer
    xs = {spec: torch.randn(spec[1], a.d_model) for spec in specs}
    times: dict[Spec, list[float]] = {spec: [] for spec in specs}
    sent: dict[Spec, list[int]] = {spec: [] for spec in specs}
    with shardps.connect(addresses, timeout=600) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.01), sync="asp")
        order = list(layers.items())
        for i in range(a.warmup + a.repeats):
            for spec, moe in order[i % len(order):] + order[:i % len(order)]:
                before = moe.stats.bytes_sent
                t0 = time.perf_counter()
                out, aux, _ = moe(xs[spec])
                (out.square().mean() + aux).backward()
                opt.step()
                opt.zero_grad()
                if i >= a.warmup:
                    times[spec].append(time.perf_counter() - t0)
                    sent[spec].append(moe.stats.bytes_sent - before)
    out: dict[Spec, dict[str, float]] = {}
    for spec, moe in layers.items():
        taken = moe.stats.placements
        out[spec] = {"seconds": statistics.median(times[spec]), "bytes": statistics.median(sent[spec]),
                     "send_share": taken["send"] / max(1, sum(taken.values())), "rounds": times[spec]}
    return out


def point(addresses: list[str], experts: int, tokens: int, a: argparse.Namespace,
          cost_model: CostModel | None = None) -> dict[str, dict[str, float]]:
    """``steps`` of three layers of ``experts`` and ``tokens``, pull, send and auto, by placement."""
    got = steps(addresses, [(experts, tokens, p) for p in PLACEMENTS], a, cost_model)
    return {p: got[(experts, tokens, p)] for p in PLACEMENTS}


def costs(a: argparse.Namespace) -> dict[str, Any]:
    """The cost model's constants on this machine (the module docstring): ``CostModel``'s fields, and the
    step times they come from (ms). Every measurement interleaved with the others, round by round."""
    params, d, few, many, e, m = sum(p.numel() for p in expert(a.d_model).parameters()), a.d_model, a.few, a.many, \
        a.experts, a.mid_experts
    cluster = _servers(a)
    try:
        with shardps.connect(cluster.addresses, timeout=600) as client:
            client.register_rows("costs_rows", params, init={"kind": "zeros"}, optimizer=SGD(lr=0.01))
            ts: dict[int, list[float]] = {1: [], e: []}
            for i in range(a.warmup + a.repeats):
                for n in ts:
                    keys = torch.arange(n)
                    t0 = time.perf_counter()
                    client.pull_rows("costs_rows", keys, track=False)
                    client.push_rows("costs_rows", keys, torch.zeros(n, params), step=2 * i + (n > 1) + 1)
                    if i >= a.warmup:
                        ts[n].append(time.perf_counter() - t0)
            rows = {n: statistics.median(v) for n, v in ts.items()}
        points = ((1, few), (1, many), (m, many), (e, many))
        got = steps(cluster.addresses, [(x, n, p) for x, n in points for p in ("pull", "send")], a)
    finally:
        cluster.stop()
    t = {(x, n): {p: got[(x, n, p)] for p in ("pull", "send")} for x, n in points}
    byte_s = max(0.0, (rows[e] - rows[1]) / ((e - 1) * 2 * (4 * params + 16)))
    fit = {}
    for p in ("pull", "send"):
        per_token = (t[(1, many)][p]["seconds"] - t[(1, few)][p]["seconds"]) / (many - few)
        # What U experts cost over 1 at ``many`` tokens (every expert routed to): a (U - 1) + b (U^2 - 1),
        # from U = m and U = e; b < 0 (cheaper per expert with more of them) is taken as 0, a from e alone.
        over = {x: (t[(x, many)][p]["seconds"] - t[(1, many)][p]["seconds"]) / (x - 1) for x in (m, e)}
        sq = (over[e] - over[m]) / (e - m)
        per_expert, sq = (over[m] - sq * (m + 1), sq) if sq > 0 else (over[e], 0.0)
        fit[p] = (per_token, max(0.0, per_expert), sq,
                  t[(1, few)][p]["seconds"] - max(0.0, per_expert) - sq - few * per_token)
    model = CostModel(
        byte_s=byte_s,
        pull_call_s=max(0.0, fit["pull"][3]),
        local_expert_s=max(0.0, fit["pull"][1] - 2 * (4 * params + 16) * byte_s),
        local_flop_s=max(0.0, fit["pull"][0] / (6 * params)),
        send_call_s=max(0.0, fit["send"][3]),
        server_expert_s=fit["send"][1],
        server_flop_s=max(0.0, (fit["send"][0] - 20 * d * byte_s) / (8 * params)),
        local_expert_sq_s=fit["pull"][2], server_expert_sq_s=fit["send"][2])
    return {"cost_model": {k: float(f"{v:.3g}") for k, v in vars(model).items()}, "expert_params": params,
            "rows_ms": {n: round(1e3 * v, 3) for n, v in rows.items()},
            "steps_ms": [{"experts": x, "tokens": n, **{p: round(1e3 * r[p]["seconds"], 3) for p in r}}
                         for (x, n), r in t.items()]}


class _Given:
    """Servers started elsewhere (``--addresses``): used, not stopped."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    def stop(self) -> None:
        pass


def _servers(a: argparse.Namespace) -> Any:
    """``--addresses``' servers, or ``--shards`` server processes on loopback (stopped by the caller)."""
    if a.addresses:
        return _Given(a.addresses)
    return shardps.LocalCluster(a.shards, processes=True).start()


def on_netsim(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """This command again, inside a simulated cluster (``shardps.netsim``): ``--shards`` server hosts and
    one worker host, every link shaped at ``--link``; the servers on theirs, the command (with
    ``--addresses``) on the worker's. Its JSON, with the cluster's shape added."""
    from shardps.netsim import NetCluster

    inner, skip = [], False
    for arg in argv:  # the same arguments, less --link and its value
        if skip:
            skip = False
        elif arg == "--link":
            skip = True
        elif not arg.startswith("--link="):
            inner.append(arg)
    with NetCluster(hosts=a.shards + 1, link=a.link) as net:
        servers = net.start_servers(list(range(a.shards)))
        done = net.run(a.shards, [sys.executable, str(Path(__file__).resolve()), *inner, "--json", "--addresses",
                                  *[s.address for s in servers]], timeout=3600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the run in the worker host failed ({done.returncode}): {done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["netsim"] = {"link": a.link, "server_hosts": a.shards, "worker_hosts": 1}
    return result


def placement_sweep(a: argparse.Namespace) -> dict[str, Any]:
    params = sum(p.numel() for p in expert(a.d_model).parameters())
    out: dict[str, Any] = {"d_model": a.d_model, "expert_params": params, "shards": a.shards, "points": [],
                           "crossover": []}
    if a.calibrate:  # the constants measured here and now, just before the sweep (``costs``'s defaults)
        measured = costs(argparse.Namespace(few=16, many=4096, experts=32, mid_experts=8, d_model=a.d_model,
                                            repeats=15, warmup=3, shards=a.shards, addresses=a.addresses))
        out["calibration"] = measured
        cm = CostModel(**measured["cost_model"])
    else:
        cm = CostModel(**json.loads(a.cost_model)) if a.cost_model else CostModel()
    out["cost_model"] = vars(cm)
    cluster = _servers(a)
    try:
        for e in a.experts:
            got = [point(cluster.addresses, e, t, a, cost_model=cm) for t in a.tokens]
            model = [predicted_bytes(e, t, 1, a.d_model, params) for t in a.tokens]
            secs = [predicted_seconds(cm, e, t, 1, a.d_model, params) for t in a.tokens]
            measured = crossover(a.tokens, [g["pull"]["seconds"] for g in got], [g["send"]["seconds"] for g in got])
            fine = [predicted_seconds(cm, e, t, 1, a.d_model, params) for t in FINE]
            predicted = crossover(FINE, [m["pull"] for m in fine], [m["send"] for m in fine])
            fine_bytes = [predicted_bytes(e, t, 1, a.d_model, params) for t in FINE]
            by_bytes = crossover(FINE, [m["pull"] for m in fine_bytes], [m["send"] for m in fine_bytes])
            for t, g, m, sec in zip(a.tokens, got, model, secs):
                better = min(("pull", "send"), key=lambda p: g[p]["seconds"])
                best = g[better]["seconds"]
                paired = statistics.median(x / y for x, y in zip(g["auto"]["rounds"], g[better]["rounds"]))
                out["points"].append({
                    "experts": e, "tokens": t, **{f"{p}_ms": round(1e3 * g[p]["seconds"], 2) for p in PLACEMENTS},
                    **{f"{p}_bytes": int(g[p]["bytes"]) for p in ("pull", "send")},
                    "model_pull_bytes": int(m["pull"]), "model_send_bytes": int(m["send"]),
                    "model_pull_ms": round(1e3 * sec["pull"], 2), "model_send_ms": round(1e3 * sec["send"], 2),
                    "auto_send_share": round(g["auto"]["send_share"], 2),
                    "auto_over_best": round(g["auto"]["seconds"] / best, 3),
                    "auto_over_best_paired": round(paired, 3)})
            out["crossover"].append({
                "experts": e, "measured_tokens": None if measured is None else round(measured),
                "model_tokens": None if predicted is None else round(predicted),
                "bytes_model_tokens": None if by_bytes is None else round(by_bytes),
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
    p.add_argument("--warmup", type=int, default=6,
                   help="rounds before those (default 6: auto's probes, 3 steps of each placement)")
    p.add_argument("--cost-model", default=None, metavar="JSON",
                   help="CostModel fields (what `costs` printed as cost_model); default: the layer's own")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the cost model's constants first, in this run (as `costs`), and use them")
    k = sub.add_parser("costs")
    k.add_argument("--few", type=int, default=16, help="tokens of the small steps (default 16)")
    k.add_argument("--many", type=int, default=4096, help="tokens of the large steps (default 4096)")
    k.add_argument("--experts", type=int, default=32, help="experts of the many-experts step (default 32)")
    k.add_argument("--mid-experts", type=int, default=8,
                   help="experts of a step between (default 8): with --experts, the U^2 term's fit")
    k.add_argument("--d-model", type=int, default=64)
    k.add_argument("--repeats", type=int, default=15)
    k.add_argument("--warmup", type=int, default=3)
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
    for q in (p, c, k):
        q.add_argument("--shards", type=int, default=2)
        q.add_argument("--json", action="store_true")
    for q in (p, k):
        q.add_argument("--addresses", nargs="+", default=None, metavar="HOST:PORT",
                       help="servers already running (one per shard), instead of --shards on loopback")
        q.add_argument("--link", default=None, metavar="RATE",
                       help="run on a simulated cluster (shardps.netsim, root): --shards server hosts and one "
                            "worker host, links shaped at RATE (e.g. 200mbit)")
    a = ap.parse_args()
    if getattr(a, "link", None):
        result = on_netsim(a, sys.argv[1:])
    else:
        result = {"placement": placement_sweep, "costs": costs, "curves": curves}[a.what](a)
    if a.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
