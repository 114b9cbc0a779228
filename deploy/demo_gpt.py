"""``shardps demo --example gpt``: the tinyshakespeare char-GPT on the demo's servers, one worker, its weights
streamed from the servers with ``--stream`` (docs/streaming.md).

The servers are processes on loopback (``LocalCluster``), as for digits; the worker is this process
(``examples/gpt_stream.py``'s ``train``), so that the peak of live parameter and gradient bytes it
reports is the one process's. The digits example's data-parallel flags (``--workers`` above 1,
``--overlap``, ``--compress``, ``--replicas``, ...) do not apply and are refused, never ignored.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

# Flags of the digits example that this one refuses when they differ from their defaults: (flag, attribute,
# default). A flag left at its default means "not asked for".
NOT_HERE = (("--overlap", "overlap", False), ("--compress", "compress", "none"), ("--plot", "plot", None),
            ("--replicas", "replicas", 1), ("--kill-server", "kill_server", None),
            ("--push-window", "push_window", None), ("--epochs", "epochs", None))


def check(args: Any) -> str | None:
    """What is wrong with ``args`` for the gpt example (one line), or None."""
    if args.workers not in (None, 1):
        return f"--example gpt trains with one worker (this process), got --workers {args.workers}"
    for flag, name, default in NOT_HERE:
        if getattr(args, name, default) != default:
            return f"{flag} does not apply to --example gpt (it is the digits example's)"
    if args.sync != "bsp":
        return f"--example gpt has one worker: its sync is bsp, got --sync {args.sync}"
    if args.max_live_mb <= 0:
        return f"--max-live-mb must be > 0, got {args.max_live_mb:g}"
    for name in ("steps", "dim", "layers", "context"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    if args.dim % 8:
        return f"--dim must be a multiple of the model's 8 heads, got {args.dim}"
    return None


def run_gpt_demo(args: Any) -> int:
    from shardps.deploy.demo import _interrupt
    from shardps.deploy.local import LocalCluster
    from shardps.examples.digits import make_spec
    from shardps.examples.gpt_stream import train

    problem = check(args)
    if problem is not None:
        print(f"shardps demo: {problem}", file=sys.stderr)
        return 2
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    budget = int(args.max_live_mb * 2**20) if args.stream else None
    batch = args.batch_size or 8
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop the servers on SIGTERM as on Ctrl-C
        signal.signal(sig, _interrupt)
    t0 = time.perf_counter()
    try:
        with LocalCluster(args.servers, processes=True) as cluster:
            say(f"shardps demo: {args.servers} servers, one worker, the char-GPT (dim {args.dim}, {args.layers} "
                f"blocks), {args.steps} steps, optimizer={args.optimizer}, "
                + (f"weights streamed within {args.max_live_mb:g} MiB" if args.stream else "weights resident"))
            out = train(cluster.addresses, dim=args.dim, layers=args.layers, heads=8, context=args.context,
                        batch_size=batch, steps=args.steps, max_live_bytes=budget, seed=args.seed,
                        log_every=max(1, args.steps // 5), say=say, optimizer=make_spec(args.optimizer, args.lr),
                        wire=args.wire)
    except KeyboardInterrupt:
        say("interrupted: stopped the servers")
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"shardps demo failed: {e}", file=sys.stderr, flush=True)
        return 1
    times = out.pop("step_seconds")
    out.update(example="gpt", stream=args.stream, servers=args.servers, steps=args.steps, optimizer=args.optimizer,
               mean_step_seconds=round(sum(times[1:]) / max(1, len(times) - 1), 4),
               seconds=round(time.perf_counter() - t0, 2))
    mb = 2**20
    say(f"model {out['params'] / 1e6:.1f}M parameters, {out['model_bytes'] / mb:.1f} MiB; peak live parameter + "
        f"gradient bytes {out['peak_live_bytes'] / mb:.2f} MiB ({out['peak_over_model']:.3f} of the model); "
        f"loss {out['first_loss']:.3f} -> {out['last_loss']:.3f} in {out['seconds']:.1f} s")
    if args.json:
        print(json.dumps(out), flush=True)
    return 0
