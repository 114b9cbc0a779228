"""A char-GPT larger than its worker's live budget: weights streamed from the servers module by module.

    .venv/bin/python -m shardps.examples.gpt_stream --max-live-mb 4 [--dim 256 --layers 4 --steps 40]

Starts ``--servers`` parameter servers as processes on loopback (the demo's
``LocalCluster``), trains the tinyshakespeare GPT of
``examples/shakespeare.py`` with one worker whose
``DistributedOptimizer(stream=shardps.Stream(max_live_bytes))`` holds only
the modules running (docs/streaming.md), and prints the loss every
``--log-every`` steps and, at the end, the model's size, the peak live
parameter + gradient bytes and their ratio. ``--resident``: the same run
with the whole model held, to compare.

On a CPU worker, run it with ``MALLOC_MMAP_THRESHOLD_=131072`` to see the
freed weights leave the process's RSS: glibc otherwise raises its mmap
threshold after the first large free, and the storage released keeps its
pages in the heap (docs/streaming.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from shardps.examples.shakespeare import Block, CharLoss, batch, load_text, make_model
from shardps.protos.optim import OptimizerSpec


def rss_bytes(key: str = "VmRSS:") -> int:
    """This process's resident set size (Linux; ``key="VmHWM:"``: its peak), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh from its RSS now (Linux 4.0+; elsewhere nothing)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def train(addresses: list[str], *, dim: int, layers: int, heads: int, context: int, batch_size: int, steps: int,
          max_live_bytes: int | None, prefetch: int = 1, keep: str = "server", lr: float = 3e-3, seed: int = 0,
          log_every: int = 10, blocks: bool = False, say: Callable[[str], None] = print,
          optimizer: OptimizerSpec | None = None, wire: str = "fp32") -> dict[str, Any]:
    """One worker trains ``steps`` steps on the servers at ``addresses``; streamed unless ``max_live_bytes``
    is None (``blocks``: each transformer block one unit, else each module with parameters of its own).
    ``optimizer``: the servers' (default Adam at ``lr``); ``wire="bf16"``: gradients up and weights down in
    bf16. Returns losses, step times, bytes."""
    import shardps

    if wire not in ("fp32", "bf16"):
        raise ValueError(f"wire must be 'fp32' or 'bf16', got {wire!r}")
    half = torch.bfloat16 if wire == "bf16" else None

    text = load_text()
    rss0 = rss_bytes()  # before the model: its first weights count in the growth (streamed, they are freed)
    reset_peak_rss()
    model = make_model(text.vocab, dim=dim, heads=heads, layers=layers, context=context, seed=seed)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    units = [m for m in model if isinstance(m, Block)] if blocks else None
    stream = (shardps.Stream(max_live_bytes, prefetch=prefetch, keep=keep, modules=units)
              if max_live_bytes is not None else None)
    loss_fn = CharLoss()
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    times: list[float] = []
    with shardps.connect(addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=optimizer or shardps.optim.Adam(lr=lr),
                                           stream=stream, grad_dtype=half, pull_dtype=half)
        if opt.stream is not None:
            opt.stream.reset_peak()
        for step in range(1, steps + 1):
            x, y = batch(text.train, batch_size, context, g)
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if step % log_every == 0 or step == steps:
                tail = losses[-log_every:]
                say(f"step {step}: loss {sum(tail) / len(tail):.3f} ({times[-1]:.2f} s/step)")
        st = opt.stream
        peak = st.peak_live_bytes if st is not None else model_bytes
        out = {"params": sum(p.numel() for p in model.parameters()), "model_bytes": model_bytes,
               "max_live_bytes": max_live_bytes, "peak_live_bytes": peak,
               "peak_over_model": round(peak / model_bytes, 4), "rss_growth_bytes": rss_bytes() - rss0,
               "peak_rss_growth_bytes": rss_bytes("VmHWM:") - rss0,
               "first_loss": round(sum(losses[:5]) / len(losses[:5]), 4),
               "last_loss": round(sum(losses[-5:]) / len(losses[-5:]), 4),
               "step_seconds": times, "units": len(st.units) if st is not None else 0,
               "largest_unit_bytes": st.largest_unit_bytes if st is not None else 0,
               "pulls_per_step": round(st.pulls / steps, 1) if st is not None else 0,
               "pull_wait_s_per_step": round(st.wait_seconds / steps, 4) if st is not None else 0}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.examples.gpt_stream", description=__doc__.split("\n")[0])
    p.add_argument("--max-live-mb", type=float, default=4.0, help="the worker's live parameter + gradient budget")
    p.add_argument("--resident", action="store_true", help="hold the whole model instead (to compare)")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--keep", choices=["server", "host"], default="server")
    p.add_argument("--blocks", action="store_true", help="stream each transformer block as one unit")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    if a.max_live_mb < 0:
        p.error(f"--max-live-mb must be >= 0, got {a.max_live_mb}")
    import shardps

    budget = None if a.resident else int(a.max_live_mb * 2**20)
    with shardps.LocalCluster(a.servers, processes=True) as cluster:
        out = train(cluster.addresses, dim=a.dim, layers=a.layers, heads=a.heads, context=a.context,
                    batch_size=a.batch_size, steps=a.steps, max_live_bytes=budget, prefetch=a.prefetch, keep=a.keep,
                    log_every=a.log_every, blocks=a.blocks)
    times = out.pop("step_seconds")
    out["mean_step_seconds"] = round(sum(times[1:]) / max(1, len(times) - 1), 4)
    if a.json:
        print(json.dumps(out))
    else:
        mb = 2**20
        print(f"model {out['params'] / 1e6:.1f}M parameters, {out['model_bytes'] / mb:.1f} MB; peak live parameter + "
              f"gradient bytes {out['peak_live_bytes'] / mb:.2f} MB ({out['peak_over_model']:.3f} of the model); "
              f"loss {out['first_loss']:.3f} -> {out['last_loss']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
