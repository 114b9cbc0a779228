"""A character-level GPT on tinyshakespeare, cut into pipeline stages, its weights on the parameter servers.

The data ships with the package (``data/tinyshakespeare.txt.gz``, public
domain, see ``data/README.md``): the first 90% of the text trains, the rest
validates. The model: token and position embeddings, pre-LayerNorm
transformer blocks (causal self-attention, a GELU MLP), a LayerNorm and the
head, as one ``nn.Sequential`` of ``2 + layers`` modules, so
``balance=[2, 2]`` cuts two blocks into two stages. ``run`` trains it with
``shardps.ray.Pipeline`` (Adafactor on the servers) and reports train and
validation loss, tokens per second and a few sampled lines:
``shardps ray --example shakespeare --stages 2 --chunks 4 --servers 2 --json``.
"""

from __future__ import annotations

import gzip
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VAL_SHARE = 0.1


@dataclass
class Text:
    train: torch.Tensor
    val: torch.Tensor
    chars: list[str]

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in s], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def load_text() -> Text:
    raw = gzip.decompress(resources.files("shardps.examples").joinpath("data/tinyshakespeare.txt.gz")
                          .read_bytes()).decode()
    if len(raw) != 1_115_394:
        raise ValueError(f"tinyshakespeare.txt.gz: expected 1,115,394 characters, got {len(raw):,}")
    chars = sorted(set(raw))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in raw], dtype=torch.long)
    n = int(len(data) * (1 - VAL_SHARE))
    return Text(data[:n], data[n:], chars)


class Embed(nn.Module):
    """Token plus position embeddings: (batch, time) ids -> (batch, time, dim)."""

    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The heads this module holds come from the tensors, so that shardps.tp.split(plan "heads") can give
        # each rank of a TP group its share of them (qkv's three parts, proj's inputs).
        b, t, d = x.shape
        q, k, v = (z.view(b, t, -1, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def make_model(vocab: int, *, dim: int = 128, heads: int = 4, layers: int = 2, context: int = 64,
               dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    """``2 + layers`` modules: Embed, the blocks, Head."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, dim, context), *[Block(dim, heads, dropout) for _ in range(layers)],
                         Head(dim, vocab))


def tp_plan(layers: int) -> dict[str, str]:
    """The tensor-parallel plan of ``make_model(layers=...)`` (``shardps.tp.split``): the token table by
    vocabulary, each block's attention by heads and MLP by columns then rows, the head by vocabulary (its
    logits feed ``TPCharLoss``). Position embeddings and layer norms stay replicated."""
    plan = {"0.tok": "vocab", f"{layers + 1}.out": "column", "*.mlp.0": "column", "*.mlp.2": "row"}
    plan.update({str(i): "heads" for i in range(1, layers + 1)})
    return plan


class CharLoss(nn.Module):
    """Cross-entropy of (batch, time, vocab) logits against (batch, time) next characters."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TPCharLoss(nn.Module):
    """``CharLoss`` of logits split by vocabulary over a TP group (``vocab_parallel_cross_entropy``)."""

    reduction = "mean"

    def __init__(self, vocab: int, group: Any = None) -> None:
        super().__init__()
        self.vocab, self.group = vocab, group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from shardps.tp import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), self.group,
                                            vocab=self.vocab)


def batch(data: torch.Tensor, size: int, context: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - context - 1, (size,), generator=g)
    return (torch.stack([data[i:i + context] for i in ix.tolist()]),
            torch.stack([data[i + 1:i + context + 1] for i in ix.tolist()]))


def evaluate(forward: Callable[[torch.Tensor], torch.Tensor], data: torch.Tensor, *, batches: int = 8,
             size: int = 32, context: int = 64, seed: int = 1) -> float:
    """Mean loss of ``forward`` on ``batches`` fixed batches of ``data``."""
    g = torch.Generator().manual_seed(seed)
    loss = CharLoss()
    with torch.no_grad():
        return sum(float(loss(forward(x), y)) for x, y in (batch(data, size, context, g) for _ in range(batches))) \
            / batches


def sample(forward: Callable[[torch.Tensor], torch.Tensor], text: Text, prompt: str = "\n", length: int = 120,
           context: int = 64, temperature: float = 0.8, seed: int = 0) -> str:
    """``length`` characters after ``prompt``, drawn from ``forward``'s next-character distribution."""
    g = torch.Generator().manual_seed(seed)
    ids = text.encode(prompt).tolist()
    for _ in range(length):
        logits = forward(torch.tensor([ids[-context:]]))[0, -1] / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)))
    return text.decode(ids[len(prompt):])


def run(args: Any, say: Callable[..., None], servers: Any) -> dict[str, Any]:
    """Train on ``servers`` through a ``shardps.ray.Pipeline`` (the ``shardps ray`` example); the summary."""
    import shardps
    import shardps.ray as sray
    from shardps.examples.digits import make_spec

    text = load_text()
    model = make_model(text.vocab, dim=args.dim, layers=args.layers, context=args.context, seed=args.seed)
    for name in ("stages", "chunks", "steps", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stages > len(model):
        raise ValueError(f"--stages {args.stages}: the model has {len(model)} modules (--layers {args.layers} + 2)")
    n = len(model)
    per = [n // args.stages + (1 if i < n % args.stages else 0) for i in range(args.stages)]
    optimizer = make_spec(args.optimizer or "adafactor", args.lr)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    tp = getattr(args, "tensor_parallel", 1)
    stream = shardps.Stream(int(args.max_live_mb * 2**20)) if getattr(args, "stream", False) else None
    with sray.Pipeline(model, balance=per, chunks=args.chunks, schedule=args.schedule, checkpoint=args.recompute,
                       offload="activations" if args.offload else None, compress=args.compress or None,
                       servers=servers, optimizer=optimizer, sync=args.sync, strategy=args.stage_strategy,
                       seed=args.seed, use_gpu=args.use_gpu, num_cpus=args.stage_cpus, replicas=args.workers,
                       tensor_parallel=tp, tp_plan=tp_plan(args.layers) if tp > 1 else None, stream=stream) as pipe:
        loss_fn: nn.Module = TPCharLoss(text.vocab) if tp > 1 else CharLoss()
        val0 = evaluate(pipe.eval, text.val, context=args.context)  # before training (starts the stages)
        start = None
        losses: list[float] = []
        train_t = 0.0
        for step in range(1, args.steps + 1):
            x, y = batch(text.train, args.batch_size, args.context, g)
            ts = time.perf_counter()
            losses.append(pipe.train_step(x, y, loss_fn))
            train_t += time.perf_counter() - ts
            if start is None:
                start = losses[0]
                say(f"step 1: train loss {start:.3f} (validation loss before training {val0:.3f}); stages on "
                    f"{[n[:8] for n in pipe.node_ids[0]]}")
            if step % args.log_every == 0 or step == args.steps:
                say(f"step {step}: train loss {sum(losses[-args.log_every:]) / len(losses[-args.log_every:]):.3f}"
                    f" ({args.batch_size * args.context * step / train_t:.0f} tokens/s)")
        val = evaluate(pipe.eval, text.val, context=args.context)
        samples = [sample(pipe.eval, text, prompt=p, context=args.context, seed=i, length=args.sample_length)
                   for i, p in enumerate(["\n", "ROMEO:\n"][:args.samples])]
        stage_nodes = pipe.node_ids[0]
        streamed = {}
        if stream is not None:  # each stage's peak of live parameter + gradient bytes, against its size
            streamed = {s: {k: st[k] for k in ("peak_live_bytes", "max_live_bytes", "model_bytes",
                                                "largest_unit_bytes", "peak_sum_bytes", "pulled_bytes")}
                        for s, st in pipe.stream_stats().items()}
            for s, st in streamed.items():
                say(f"stage {s}: peak live {st['peak_live_bytes'] / 2**20:.2f} MiB of its "
                    f"{st['model_bytes'] / 2**20:.2f} MiB (budget {st['max_live_bytes'] / 2**20:g} MiB)")
    tail = losses[-min(len(losses), 20):]
    return {"train_loss": round(sum(tail) / len(tail), 4), "val_loss": round(val, 4), "initial_train_loss":
            round(start or math.nan, 4), "initial_val_loss": round(val0, 4), "steps": args.steps,
            "tokens_per_second": round(args.batch_size * args.context * args.steps / train_t, 1),
            "seconds": round(time.perf_counter() - t0, 2), "stages": args.stages, "chunks": args.chunks,
            "tensor_parallel": tp, "replicas": args.workers,
            "schedule": args.schedule, "stage_nodes": stage_nodes, "samples": samples,
            **({"stream": streamed} if stream is not None else {})}
