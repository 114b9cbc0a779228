"""``shardps demo --example gpt``, ``--example moe`` and ``--example movielens``: the examples beside digits.

- ``gpt``: the tinyshakespeare char-GPT, one worker, its weights streamed from the servers with ``--stream``
  (docs/streaming.md). The servers are processes on loopback (``LocalCluster``), as for digits; the worker
  is this process (``examples/gpt_stream.py``'s ``train``), so that the peak of live parameter and
  gradient bytes it reports is the one process's.
- ``moe``: a char-GPT with mixture-of-experts layers (``examples/moe_gpt.py``, docs/moe.md): the servers
  in this process, the workers as its threads, bsp.
- ``movielens``: matrix factorisation on MovieLens-100K with its user and item tables on the servers
  (``examples/movielens.py``, docs/sparse.md): the servers in this process, one worker (this process),
  then the same model in one process; prints both test RMSEs. The data comes from the ``recbole`` wheel
  (``make venv`` installs it).

The model's size and length (``--steps``, ``--dim``, ``--layers``, ``--context``) have defaults per example
(movielens takes ``--dim``, ``--epochs``, ``--batch-size`` and ``--lr``).
Flags an example does not use (the digits example's ``--overlap``, ``--compress``, ``--replicas``, ...; the
gpt example's ``--stream`` on another) are refused, never ignored.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

GPT_DEFAULTS = {"steps": 30, "dim": 512, "layers": 8, "context": 64}  # 25M parameters, 101 MB

# Flags of the digits example that the others refuse when they differ from their defaults: (flag, attribute,
# default). A flag left at its default means "not asked for".
DIGITS_ONLY = (("--overlap", "overlap", False), ("--compress", "compress", "none"), ("--plot", "plot", None),
               ("--replicas", "replicas", 1), ("--kill-server", "kill_server", None),
               ("--push-window", "push_window", None), ("--epochs", "epochs", None))
GPT_ONLY = (("--stream", "stream", False), ("--max-live-mb", "max_live_mb", 64.0))
MOE_ONLY = (("--experts", "experts", 8), ("--top-k", "top_k", 1), ("--placement", "placement", "pull"),
            ("--capacity-factor", "capacity_factor", 1.25), ("--eval-every", "eval_every", 50))
MODEL = (("--steps", "steps", None), ("--dim", "dim", None), ("--layers", "layers", None),
         ("--context", "context", None))


def _refused(args: Any, example: str, flags: tuple[tuple[str, str, object], ...], whose: str) -> str | None:
    for flag, name, default in flags:
        if getattr(args, name, default) != default:
            return f"{flag} does not apply to --example {example} (it is {whose})"
    return None


def digits_problem(args: Any) -> str | None:
    """What ``shardps demo`` (the digits example) was given that it does not use (one line), or None."""
    return (_refused(args, "digits", MODEL, "the char-GPTs'") or _refused(args, "digits", GPT_ONLY, "gpt's")
            or _refused(args, "digits", MOE_ONLY, "moe's"))


def check(args: Any) -> str | None:
    """What is wrong with ``args`` for the gpt example (one line), or None."""
    if args.workers not in (None, 1):
        return f"--example gpt trains with one worker (this process), got --workers {args.workers}"
    problem = (_refused(args, "gpt", DIGITS_ONLY, "the digits example's")
               or _refused(args, "gpt", MOE_ONLY, "moe's"))
    if problem is not None:
        return problem
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


def _fixed(args: Any, example: str) -> str | None:
    """The settings an example trains with whatever is asked: bsp, Adam, fp32 on the wire."""
    for flag, name, default in (("--sync", "sync", "bsp"), ("--optimizer", "optimizer", "adam"),
                                ("--wire", "wire", "fp32")):
        if getattr(args, name) != default:
            return f"--example {example} trains with {flag} {default}, got {getattr(args, name)}"
    return None


def check_moe(args: Any) -> str | None:
    """What is wrong with ``args`` for the moe example (one line), or None."""
    problem = (_refused(args, "moe", DIGITS_ONLY, "the digits example's")
               or _refused(args, "moe", GPT_ONLY, "gpt's"))
    return problem if problem is not None else _fixed(args, "moe")


def check_movielens(args: Any) -> str | None:
    """What is wrong with ``args`` for the movielens example (one line), or None."""
    if args.workers not in (None, 1):
        return f"--example movielens trains with one worker (this process), got --workers {args.workers}"
    digits = tuple(f for f in DIGITS_ONLY if f[1] != "epochs") + (("--seed", "seed", 0),)
    problem = (_refused(args, "movielens", digits, "the digits example's (the split and the init are fixed)")
               or _refused(args, "movielens", GPT_ONLY, "gpt's") or _refused(args, "movielens", MOE_ONLY, "moe's")
               or _refused(args, "movielens", tuple(f for f in MODEL if f[1] != "dim"), "the char-GPTs'"))
    if problem is not None:
        return problem
    for flag, value in (("--dim", args.dim), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.lr is not None and not args.lr > 0:
        return f"--lr must be > 0, got {args.lr:g}"
    return _fixed(args, "movielens")


def run_movielens_demo(args: Any) -> int:
    """``shardps demo --example movielens``: both test RMSEs, as JSON with ``--json``."""
    problem = check_movielens(args)
    if problem is not None:
        print(f"shardps demo: {problem}", file=sys.stderr)
        return 2
    from shardps.examples.movielens import DEFAULTS, run

    given = {"dim": args.dim, "epochs": args.epochs, "batch": args.batch_size, "lr": args.lr}
    s: dict[str, Any] = {k: DEFAULTS[k] if v is None else v for k, v in given.items()}
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"shardps demo: MovieLens-100K, matrix factorisation (dim {s['dim']}), its four tables on {args.servers} "
        f"servers in this process, {s['epochs']} epochs of batches of {s['batch']}, SparseAdam lr {s['lr']:g}; then "
        "the same model in one process")
    t0 = time.perf_counter()
    try:
        out: dict[str, Any] = run(None, servers=args.servers, **s)
    except FileNotFoundError as e:
        print(f"shardps demo: {e}", file=sys.stderr)
        return 1
    out.update(example="movielens", seconds=round(time.perf_counter() - t0, 2))
    say(f"test RMSE {out['rmse']:.4f} (one process: {out['reference_rmse']:.4f}) in {out['seconds']:.1f} s")
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


def run_example(args: Any) -> int:
    """``shardps demo --example gpt|moe|movielens``: the model's defaults filled in, the flags checked, the
    example run."""
    from shardps.examples.moe_flags import MODEL_DEFAULTS as MOE_DEFAULTS

    if args.example == "movielens":
        return run_movielens_demo(args)

    for name, default in (GPT_DEFAULTS if args.example == "gpt" else MOE_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.example == "gpt":
        return run_gpt_demo(args)
    problem = check_moe(args)
    if problem is not None:
        print(f"shardps demo: {problem}", file=sys.stderr)
        return 2
    from shardps.examples.moe_gpt import run_cli

    args.workers = 2 if args.workers is None else args.workers
    args.batch_size = 64 if args.batch_size is None else args.batch_size
    return run_cli(args)


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
