"""A char-GPT on tinyshakespeare whose MLPs are mixtures of experts living on the servers (docs/moe.md).

    shardps demo --example moe --experts 8 --steps 200 --json
    python -m shardps.examples.moe_gpt --experts 8 --steps 200 --json

The model is examples/shakespeare.py's (token and position embeddings,
pre-LayerNorm blocks, the head) with each block's MLP a ``shardps.nn.MoE``:
``--experts`` experts of that MLP's shape (``Linear(dim, 4 dim)``, GELU,
``Linear(4 dim, dim)``), top-``--top-k`` routing, their rows stepped on the
servers with SparseAdam; ``--experts 0`` is the dense model with the same
active parameters (top-1). The dense part (attention, embeddings, gates)
is stepped with Adam on the servers. Training minimises the cross-entropy
plus every layer's balancing loss; the summary reports the validation loss
before and after, the layers' dropped assignments and the placements taken
(evaluation forwards included). The servers run in this process, the
workers as its threads (bsp, each ``--batch-size / --workers`` sequences).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

import shardps
from shardps.examples.moe_flags import add_flags
from shardps.examples.shakespeare import Block, CharLoss, Embed, Head, Text, batch, evaluate, load_text
from shardps.protos.optim import Adam, SparseAdam
from shardps.worker.experts.moe import MoE


class Experts(nn.Module):
    """A ``MoE`` where a block wants its MLP: returns the output, keeps the balancing loss in ``aux``."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.aux, _ = self.moe(x)
        return out


class MoEGPT(nn.Module):
    """Embed, blocks, head; ``aux_loss()``: the sum of the MoE layers' balancing losses of the last forward."""

    def __init__(self, vocab: int, *, dim: int, layers: int, heads: int, context: int, experts: int, top_k: int,
                 placement: str, lr: float, capacity_factor: float) -> None:
        super().__init__()
        self.embed = Embed(vocab, dim, context)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        if experts:
            for i, b in enumerate(self.blocks):
                b.mlp = Experts(MoE(dim, experts, lambda: nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                                        nn.Linear(4 * dim, dim)),
                                    name=f"experts{i}", top_k=top_k, capacity_factor=capacity_factor,
                                    placement=placement, optimizer=SparseAdam(lr=lr)))
        self.head = Head(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out

    def aux_loss(self) -> torch.Tensor:
        return sum((b.mlp.aux for b in self.blocks if isinstance(b.mlp, Experts)), torch.zeros(()))

    def moes(self) -> list[MoE]:
        return [b.mlp.moe for b in self.blocks if isinstance(b.mlp, Experts)]


def train(model: MoEGPT, client: Any, text: Text, *, steps: int, batch_size: int, context: int, lr: float,
          seed: int, eval_every: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Train ``model`` through ``client`` (bsp over the client's workers, ``batch_size`` sequences each); the
    validation curve (evaluated by worker 0) and the summary."""
    opt = shardps.DistributedOptimizer(model, client, optimizer=Adam(lr=lr), sync="bsp")
    g = torch.Generator().manual_seed(seed + client.worker_id)
    loss_fn = CharLoss()
    first = client.worker_id == 0
    curve = [(0, evaluate(model, text.val, context=context))] if first else []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = batch(text.train, batch_size, context, g)
        loss = loss_fn(model(x), y)
        (loss + model.aux_loss()).backward()
        opt.step()
        opt.zero_grad()
        if first and (step % eval_every == 0 or step == steps):
            curve.append((step, evaluate(model, text.val, context=context)))
            say(f"step {step}: train loss {float(loss.detach()):.3f}, validation loss {curve[-1][1]:.3f}")
    if not first:
        return {}
    seconds = time.perf_counter() - t0
    moes = model.moes()
    return {"val_loss": round(curve[-1][1], 4), "initial_val_loss": round(curve[0][1], 4), "steps": steps,
            "curve": [(s, round(v, 4)) for s, v in curve], "seconds": round(seconds, 2),
            "tokens_per_second": round(batch_size * context * steps / seconds, 1),
            "dropped": sum(m.stats.dropped for m in moes), "assignments": sum(m.stats.assignments for m in moes),
            "placements": {p: sum(m.stats.placements[p] for m in moes) for p in ("pull", "send")},
            "experts_pulled": sum(m.stats.experts_pulled for m in moes),
            "payload_bytes": sum(m.stats.bytes_sent for m in moes)}


def run(args: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """Start ``args.servers`` servers in this process, train, return the summary."""
    for name in ("steps", "servers", "workers", "layers", "dim"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    text = load_text()
    models = []
    for _ in range(args.workers):  # the same seed: every worker starts from the same weights
        torch.manual_seed(args.seed)
        models.append(MoEGPT(text.vocab, dim=args.dim, layers=args.layers, heads=4, context=args.context,
                             experts=args.experts, top_k=args.top_k, placement=args.placement, lr=args.lr,
                             capacity_factor=args.capacity_factor))
    per = max(1, args.batch_size // args.workers)
    with shardps.LocalCluster(args.servers) as cluster:
        def worker(k: int) -> dict[str, Any]:
            with shardps.connect(cluster.addresses, worker_id=k, num_workers=args.workers) as client:
                return train(models[k], client, text, steps=args.steps, batch_size=per, context=args.context,
                             lr=args.lr, seed=args.seed, eval_every=args.eval_every, say=say)

        with ThreadPoolExecutor(args.workers) as pool:  # workers as threads of this process (bsp)
            summaries = list(pool.map(worker, range(args.workers), timeout=args.timeout))
    return {"experts": args.experts, "top_k": args.top_k, "placement": args.placement, "workers": args.workers,
            "batch_per_worker": per, **summaries[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(p)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = p.parse_args(argv)
    summary = run(args, print)
    if args.json:
        print(json.dumps(summary))
    return 0


def run_cli(args: Any) -> int:
    """``shardps demo --example moe``: the demo's flags (``--lr`` default 3e-3) and the example's."""
    if args.lr is None:
        args.lr = 3e-3
    try:
        summary = run(args, (lambda _: None) if args.quiet or args.json else print)
    except ValueError as e:
        print(f"shardps demo --example moe: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"validation loss {summary['initial_val_loss']} -> {summary['val_loss']} in {summary['steps']} steps "
              f"({summary['tokens_per_second']} tokens/s); dropped {summary['dropped']} of "
              f"{summary['assignments']} assignments; placements {summary['placements']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
