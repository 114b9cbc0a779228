"""``shardps ray``: its flags and its dispatch (the job itself: deploy/ray/job.py; see docs/ray.md)."""

from __future__ import annotations

import argparse
import sys

from shardps.cliargs import OPTIMIZERS, sync_mode
from shardps.protos import env


def add_ray_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Adds ``ray`` to the ``shardps`` subcommands ``sub``; returns its parser."""
    from shardps.worker.pipeline.names import CHECKPOINT_MODES, ENCODINGS
    from shardps.worker.pipeline.schedule import SCHEDULES

    ry = sub.add_parser("ray", help="train an example on the Ray cluster this runs on (a `ray job submit` entrypoint)",
                        description="Servers and workers as Ray actors placed by placement groups; see docs/ray.md.")
    ry.add_argument("--example", choices=["digits", "shakespeare"], default="digits",
                    help="digits: an MLP, data-parallel workers; shakespeare: a char-GPT in pipeline stages")
    ry.add_argument("--servers", type=int, default=2)
    ry.add_argument("--workers", type=int, default=None,
                    help="data-parallel workers (digits, default 2) or pipeline replicas (shakespeare, default 1)")
    ry.add_argument("--sync", type=sync_mode, default="bsp", help="bsp, asp, every:X or ssp:S (default bsp)")
    ry.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                    help="default: adam for digits, adafactor for shakespeare")
    ry.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    ry.add_argument("--epochs", type=int, default=10, help="passes over the data (default 10)")
    ry.add_argument("--batch-size", type=int, default=64, help="global batch, split over workers")
    ry.add_argument("--seed", type=int, default=0)
    ry.add_argument("--strategy", default="SPREAD", type=str.upper,
                    choices=("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"),
                    help="how the servers' placement group spreads them over nodes (default SPREAD)")
    ry.add_argument("--worker-strategy", default="SPREAD", type=str.upper,
                    choices=("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"), help="the same for the workers")
    ry.add_argument("--server-resources", default=None, metavar="JSON",
                    help="extra resources each server asks for, e.g. '{\"ps\": 0.001}' to keep them on CPU nodes")
    ry.add_argument("--server-cpus", type=float, default=1.0, help="CPUs per server actor (default 1)")
    ry.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs per worker actor (default 1)")
    ry.add_argument("--use-gpu", action="store_true", help="one GPU per worker actor")
    ry.add_argument("--replicas", type=int, choices=(1, 2), default=1, help="2: a live backup of every shard")
    ry.add_argument("--coordinator", default=env.get(env.COORDINATOR), metavar="etcd://HOST:PORT|actor",
                    help="who serves each shard is etcd's to say: an etcd the nodes reach, or 'actor' to run "
                         f"Debian's etcd in an actor of the cluster (docs/ray.md; env {env.COORDINATOR})")
    ry.add_argument("--checkpoint-dir", default=env.get(env.CHECKPOINT_DIR),
                    help=f"servers checkpoint here (env {env.CHECKPOINT_DIR})")
    ry.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps")
    ry.add_argument("--max-restarts", type=int, default=0,
                    help="Ray restarts a dead server actor this often (needs --checkpoint-dir; the job rolls back)")
    ry.add_argument("--metrics", action="store_true", help="servers and workers serve Prometheus /metrics")
    ry.add_argument("--prometheus-sd", default=None, metavar="FILE",
                    help="write the metrics endpoints as a Prometheus file_sd JSON file (with --metrics)")
    ry.add_argument("--address", default=None,
                    help="the Ray cluster (default: the job's own, else RAY_ADDRESS, else a local one)")
    ry.add_argument("--placement-timeout", type=float, default=120.0,
                    help="give up placing servers or workers after this many seconds (default 120)")
    ry.add_argument("--timeout", type=float, default=3600.0, help="give up training after this many seconds")
    ry.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    ry.add_argument("--quiet", action="store_true", help="no progress output")
    pg = ry.add_argument_group("pipeline (--example shakespeare)")
    pg.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    pg.add_argument("--chunks", type=int, default=4, help="micro-batches per step (default 4)")
    pg.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    pg.add_argument("--recompute", choices=CHECKPOINT_MODES, default="except_last",
                    help="activation recomputation (default except_last)")
    pg.add_argument("--offload", action="store_true", help="offload saved activations to an offload store actor")
    pg.add_argument("--compress", choices=ENCODINGS, default=None,
                    help="encoding of offloaded activations")
    pg.add_argument("--stage-strategy", default="SPREAD", type=str.upper,
                    choices=("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"), help="placement of the stages")
    pg.add_argument("--stage-cpus", type=float, default=1.0, help="CPUs per stage actor (default 1)")
    pg.add_argument("--tensor-parallel", type=int, default=1,
                    help="actors per stage, its layers split over them (docs/tensor-parallel.md; default 1)")
    pg.add_argument("--stream", action="store_true",
                    help="stream each stage's weights from the servers unit by unit, at most --max-live-mb held "
                         "(docs/streaming.md)")
    pg.add_argument("--max-live-mb", type=float, default=64.0,
                    help="with --stream: each stage's budget of live parameter + gradient MiB (default 64)")
    pg.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    pg.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    pg.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    pg.add_argument("--context", type=int, default=64, help="characters per sample (default 64)")
    pg.add_argument("--samples", type=int, default=2, help="sampled lines to report (default 2)")
    pg.add_argument("--sample-length", type=int, default=120, help="characters per sample (default 120)")
    pg.add_argument("--log-every", type=int, default=50, help="progress every N steps (default 50)")
    return ry


def run_ray(args: argparse.Namespace) -> int:
    try:
        from shardps.deploy.ray.job import default_workers, run_job
    except ImportError as e:
        print(f"shardps ray: {e}; install Ray: pip install 'shardps[ray]'", file=sys.stderr)
        return 2
    default_workers(args)
    for name in ("servers", "workers", "epochs", "tensor_parallel"):
        if getattr(args, name) < 1:
            print(f"shardps ray: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.stream and args.example != "shakespeare":
        print("shardps ray: --stream streams a pipeline's stages: use it with --example shakespeare", file=sys.stderr)
        return 2
    if args.stream and not args.max_live_mb > 0:
        print(f"shardps ray: --max-live-mb must be > 0, got {args.max_live_mb:g}", file=sys.stderr)
        return 2
    return run_job(args)
