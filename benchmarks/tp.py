"""Tensor parallelism counted and timed: collectives and their bytes, parameter and activation bytes per rank,
the char-GPT's step time at TP = 1, 2 (4).

    .venv/bin/python benchmarks/tp.py [--tp 1 2 4] [--dim 128] [--layers 2] [--batch 16] [--context 64]
                                      [--steps 5] [--json]

The TP ranks are threads of this process, each with its own gloo group (loopback TCP), so all of them
share this machine's cores: on 2 cores no speedup is expected; the point is what is counted. Per TP size,
for the char-GPT of ``examples/shakespeare.py`` split by its ``tp_plan`` (vocabulary-parallel embedding
and head, attention by heads, MLP by columns then rows):

- all-reduces in forward and in backward per transformer block, counted by the group (``TPGroup.collectives``)
  over one step, minus those of the embedding and the loss (counted on a model without blocks), and the
  bytes they carried per rank;
- parameter bytes per rank (its slices plus the replicated tensors), against TP = 1's;
- saved-activation bytes per rank (what autograd keeps for backward, through ``saved_tensors_hooks``, each
  storage once), against TP = 1's;
- the median step time (forward, backward, no servers) and its ratio to TP = 1's, same process;
- with ``--servers N`` (default 2; 0: none), the parameter-server bytes of one ``TPOptimizer`` step per rank,
  counted on the wire (``shardps.testing.wire.count_wire``: the data connection's frames, no shared memory):
  the gradient bytes of the Push messages it sent and the weight bytes of the Pull responses it
  received (its slices of the split tensors; the replicated tensors it owns, pushed, and all of them,
  pulled, whole), largest and smallest over the ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import torch

import shardps
import shardps.tp as tp
from shardps.examples import shakespeare as gpt
from shardps.testing.wire import count_wire

VOCAB = 65  # tinyshakespeare's characters
RNG = threading.Lock()


def _groups(p: int, name: str) -> list[tp.TPGroup]:
    store = torch.distributed.HashStore()
    out: list[Any] = [None] * p
    threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, tp.open_tp_group(store, name, k, p,
                                                                                        timeout=120)))
               for k in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return out


def _on_ranks(groups: list[tp.TPGroup], fn: Any) -> list[Any]:
    results: list[Any] = [None] * len(groups)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = fn(k, groups[k])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return results


def measure(p: int, args: argparse.Namespace) -> dict[str, Any]:
    groups = _groups(p, f"tp/bench{p}") if p > 1 else [tp.TPGroup.single()]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(VOCAB, (args.batch, args.context), generator=g)
    y = torch.randint(VOCAB, (args.batch, args.context), generator=g)

    def rank(k: int, group: tp.TPGroup) -> dict[str, Any]:
        def build(layers: int) -> torch.nn.Module:
            with RNG:  # the ranks are threads sharing the default random stream: seeded and drawn one at a time
                m = gpt.make_model(VOCAB, dim=args.dim, heads=4, layers=layers, context=args.context, seed=0)
            return tp.split(m, gpt.tp_plan(layers), group, strict=False)  # no blocks: no "*.mlp.0"

        loss_fn = gpt.TPCharLoss(VOCAB, group)
        counts: dict[str, dict[str, int]] = {}
        for name, layers in (("edges", 0), ("model", args.layers)):  # collectives outside the blocks, then all
            m = build(layers)
            group.collectives.clear()
            group.bytes.clear()
            loss = loss_fn(m(x), y)
            fwd, fwd_bytes = dict(group.collectives), sum(group.bytes.values())
            loss.backward()
            counts[name] = {"forward": fwd.get("all_reduce_sum", 0) + fwd.get("all_reduce_max", 0),
                            "backward": sum(v for c, v in group.collectives.items() if c.startswith("all_reduce"))
                            - fwd.get("all_reduce_sum", 0) - fwd.get("all_reduce_max", 0),
                            "bytes": sum(group.bytes.values()), "forward_bytes": fwd_bytes}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(m(x), y)
        act = sum(n for ptr, n in saved.items()
                  if ptr not in {q.untyped_storage().data_ptr() for q in m.parameters()})
        loss.backward()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            m.zero_grad()
            loss_fn(m(x), y).backward()
            times.append(time.perf_counter() - t0)
        blocks = max(args.layers, 1)
        return {"forward_all_reduces_per_block": (counts["model"]["forward"] - counts["edges"]["forward"]) / blocks,
                "backward_all_reduces_per_block": (counts["model"]["backward"] - counts["edges"]["backward"])
                / blocks,
                "all_reduces_edges": counts["edges"]["forward"] + counts["edges"]["backward"],
                "collective_bytes_per_step": counts["model"]["bytes"],
                "param_bytes": sum(q.numel() * q.element_size() for q in m.parameters()),
                "activation_bytes": act, "step_s": statistics.median(times)}

    per_rank = _on_ranks(groups, rank)
    out = dict(per_rank[0])
    out["param_bytes"] = max(r["param_bytes"] for r in per_rank)
    out["activation_bytes"] = max(r["activation_bytes"] for r in per_rank)
    out["step_s"] = max(r["step_s"] for r in per_rank)
    return out


def measure_ps(p: int, args: argparse.Namespace) -> dict[str, Any]:
    """One TPOptimizer step per rank through ``args.servers`` in-process servers: bytes on the wire per rank."""
    groups = _groups(p, f"tp/ps{p}") if p > 1 else [tp.TPGroup.single()]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(VOCAB, (args.batch, args.context), generator=g)
    y = torch.randint(VOCAB, (args.batch, args.context), generator=g)
    with shardps.LocalCluster(args.servers) as cluster:
        def rank(k: int, group: tp.TPGroup) -> tuple[int, int]:
            with RNG:
                m = gpt.make_model(VOCAB, dim=args.dim, heads=4, layers=args.layers, context=args.context, seed=0)
            m = tp.split(m, gpt.tp_plan(args.layers), group)
            with shardps.connect(cluster.addresses, worker_id=k, num_workers=p, shm=False) as client:
                opt = tp.TPOptimizer(m, client, group, optimizer=shardps.optim.Adam())
                pulled, pushed = count_wire(client)
                gpt.TPCharLoss(VOCAB, group)(m(x), y).backward()
                opt.step()
                return sum(pushed.values()), sum(pulled.values())

        per_rank = _on_ranks(groups, rank)
    return {"ps_push_bytes_max": max(a for a, _ in per_rank), "ps_push_bytes_min": min(a for a, _ in per_rank),
            "ps_pull_bytes_max": max(b for _, b in per_rank), "ps_pull_bytes_min": min(b for _, b in per_rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--servers", type=int, default=2, help="parameter servers for the bytes on the wire (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {p: measure(p, args) for p in args.tp}
    base = rows[min(rows)]
    for r in rows.values():
        r["param_ratio"] = round(r["param_bytes"] / base["param_bytes"], 3)
        r["activation_ratio"] = round(r["activation_bytes"] / base["activation_bytes"], 3)
        r["step_ratio"] = round(r["step_s"] / base["step_s"], 2)
    print("| TP | all-reduces/block fwd | bwd | collective MiB/step/rank | param MiB/rank | x TP1 | "
          "activation MiB/rank | x TP1 | step ms | x TP1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p, r in rows.items():
        print(f"| {p} | {r['forward_all_reduces_per_block']:g} | {r['backward_all_reduces_per_block']:g} | "
              f"{r['collective_bytes_per_step'] / 2**20:.2f} | {r['param_bytes'] / 2**20:.2f} | {r['param_ratio']} | "
              f"{r['activation_bytes'] / 2**20:.2f} | {r['activation_ratio']} | {r['step_s'] * 1e3:.0f} | "
              f"{r['step_ratio']} |")
    if args.servers:
        for p, r in rows.items():
            r.update(measure_ps(p, args))
        print(f"\nOne TPOptimizer step through {args.servers} servers, bytes on the wire per rank (KiB, "
              f"largest / smallest over the ranks):\n")
        print("| TP | push sent | push x TP1 | pull received | pull x TP1 |")
        print("|---|---|---|---|---|")
        for p, r in rows.items():
            print(f"| {p} | {r['ps_push_bytes_max'] / 1024:.0f} / {r['ps_push_bytes_min'] / 1024:.0f} | "
                  f"{r['ps_push_bytes_max'] / base['ps_push_bytes_max']:.3f} | "
                  f"{r['ps_pull_bytes_max'] / 1024:.0f} / {r['ps_pull_bytes_min'] / 1024:.0f} | "
                  f"{r['ps_pull_bytes_max'] / base['ps_pull_bytes_max']:.3f} |")
    if args.json:
        print(json.dumps({str(p): r for p, r in rows.items()}))


if __name__ == "__main__":
    main()
