"""``shardps ray``: an example trained on the Ray cluster this process runs on (a Ray job's entrypoint).

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        shardps ray --example digits --servers 2 --workers 2 --json

Connects to the cluster (inside a job the address comes from Ray; outside,
``--address`` or ``RAY_ADDRESS``), starts the servers and the workers as
actors placed by placement groups, trains, evaluates the weights the
servers hold, prints progress on stderr and, with ``--json``, one JSON
line at the end. SIGTERM (``ray job stop``) and Ctrl-C stop the actors and
free the placement groups on the way out.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Any

from shardps.deploy.ray.workers import WorkerContext


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def digits_loop(ctx: WorkerContext) -> dict[str, Any]:
    """One worker of the digits example on Ray (reports its loss every 20 steps)."""
    from shardps.examples.digits import train_worker

    c = ctx.config
    client = ctx.client

    def on_step(step: int, loss: float) -> None:
        if step == 1 and client.metrics_endpoint is not None:  # registered: its /metrics is up
            ctx.report({"metrics_address": client.metrics_endpoint.address, "node_id": ctx.node_id})
        if step % 20 == 0:
            ctx.report({"step": step, "loss": round(loss, 4)})

    out = train_worker(None, None, None, client=client, sync=c["sync"], optimizer=c["optimizer"],
                       lr=c.get("lr"), epochs=c["epochs"], batch_size=c["batch_size"], seed=c["seed"],
                       on_step=on_step)
    out.pop("losses", None)
    return {**out, "node_id": ctx.node_id}


def default_workers(args: Any) -> int:
    """``--workers``, or its default: 2 data-parallel workers (digits), 1 pipeline (shakespeare)."""
    if args.workers is None:
        args.workers = 1 if args.example == "shakespeare" else 2
    return int(args.workers)


def needed_cpus(args: Any) -> float:
    """CPUs the run asks Ray for: servers (a backup lives in another server's actor) and workers, or stages
    (times their TP ranks and the pipeline replicas)."""
    servers = args.servers * args.server_cpus
    if args.example == "shakespeare":
        return servers + args.stages * args.stage_cpus * args.tensor_parallel * default_workers(args)
    return servers + default_workers(args) * args.worker_cpus


def _init_ray(args: Any, say: Any) -> None:
    """Connect to the job's cluster, RAY_ADDRESS or ``--address``; with none of them, Ray starts one
    on this machine, and it is given as many logical CPUs as the run asks for (at least the real ones),
    so that the example also runs on a laptop with fewer cores (slower, oversubscribed)."""
    import ray

    if args.address is None and not os.environ.get("RAY_ADDRESS"):
        need = needed_cpus(args)
        cpus = max(os.cpu_count() or 1, math.ceil(need))
        try:
            ray.init(num_cpus=cpus, log_to_driver=not args.quiet)
        except ValueError as e:  # a cluster started with `ray start` on this machine: Ray connects to it
            if "existing cluster" not in str(e):
                raise
        else:
            if cpus > (os.cpu_count() or 1):
                say(f"local Ray with {cpus} logical CPUs for {need:g} asked on {os.cpu_count()} cores")
            return
    ray.init(address=args.address, log_to_driver=not args.quiet)


def run_job(args: Any) -> int:

    from shardps.deploy.ray.etcd import start_etcd
    from shardps.deploy.ray.pipeline import PipelineError
    from shardps.deploy.ray.placement import PlacementError
    from shardps.deploy.ray.servers import start_servers
    from shardps.deploy.ray.workers import WorkerGroup, WorkersFailed
    from shardps.examples.digits import evaluate

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    t0 = time.perf_counter()
    servers = workers = etcd = None
    fencing: dict[str, Any] = {}  # the servers' coordinator and job (--coordinator)
    try:
        _init_ray(args, say)
        resources = json.loads(args.server_resources) if args.server_resources else None
        who = (f"{args.stages} pipeline stages, {args.chunks} micro-batches" if args.example == "shakespeare"
               else f"{args.workers} workers")
        say(f"shardps ray: {args.servers} servers ({args.strategy}), {who}, sync={args.sync}, "
            f"optimizer={args.optimizer or 'default'}, on {args.example}")
        if args.coordinator:
            url = args.coordinator
            if url == "actor":
                etcd = start_etcd(resources=resources)
                url = etcd.url
                say(f"etcd in an actor at {url}")
            fencing = {"coordinator": url, "job": f"ray-{os.getpid()}"}
        servers = start_servers(args.servers, replicas=args.replicas, strategy=args.strategy, resources=resources,
                                num_cpus=args.server_cpus, checkpoint_dir=args.checkpoint_dir,
                                checkpoint_every=args.checkpoint_every,
                                metrics_port=0 if args.metrics else None, max_restarts=args.max_restarts,
                                placement_timeout=args.placement_timeout, **fencing)
        started = time.perf_counter() - t0
        say(f"servers up at {', '.join(servers.addresses)} in {started:.1f}s")
        if args.example == "shakespeare":
            from shardps.examples.shakespeare import run as run_shakespeare

            out = run_shakespeare(args, say, servers)
            out.update(servers=args.servers, server_nodes=servers.node_ids, sync=args.sync,
                       optimizer=args.optimizer or "adafactor", startup_seconds=round(started, 2))
            say(f"validation loss {out['initial_val_loss']} -> {out['val_loss']} in {out['steps']} steps, "
                f"{out['tokens_per_second']:.0f} tokens/s")
            for line in out["samples"]:
                say("sample: " + line.replace("\n", " / "))
            if args.json:
                print(json.dumps(out), flush=True)
            return 0
        config = {"sync": args.sync, "optimizer": args.optimizer or "adam", "lr": args.lr, "epochs": args.epochs,
                  "batch_size": args.batch_size, "seed": args.seed}
        workers = WorkerGroup(servers, args.workers, use_gpu=args.use_gpu, num_cpus=args.worker_cpus,
                              strategy=args.worker_strategy, config=config, metrics=args.metrics,
                              placement_timeout=args.placement_timeout)
        targets = servers.prometheus_targets()
        if args.prometheus_sd:
            _write_targets(args.prometheus_sd, targets)

        def on_report(r: dict[str, Any]) -> None:
            if "metrics_address" in r:  # a worker's /metrics is up: scrape it too
                targets.append({"targets": [r["metrics_address"]],
                                "labels": {"job": "shardps-worker", "worker": str(r["worker_id"]),
                                           "ray_node_id": r.get("node_id", "")}})
                if args.prometheus_sd:
                    _write_targets(args.prometheus_sd, targets)
            elif r["worker_id"] == 0:
                say(f"worker 0: step {r['step']}, loss {r['loss']}")

        results = workers.run(digits_loop, on_report=on_report, timeout=args.timeout)
        test_acc = evaluate(servers.addresses, seed=args.seed)
    except KeyboardInterrupt:
        say("interrupted: stopping the workers and servers")
        return 130
    except (PlacementError, PipelineError, WorkersFailed, TimeoutError, ValueError) as e:
        print(f"shardps ray failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        from shardps.deploy.demo import _signals_deferred

        with _signals_deferred("shardps ray"):  # a second Ctrl-C or SIGTERM must not cut the clean-up short
            for group in (workers, servers, etcd):
                if group is not None:
                    group.shutdown()
    seconds = time.perf_counter() - t0
    summary = {
        "test_accuracy": round(test_acc, 4),
        "steps": max(r["steps"] for r in results),
        "seconds": round(seconds, 2),
        "startup_seconds": round(started, 2),
        "servers": args.servers,
        "workers": args.workers,
        "sync": args.sync,
        "optimizer": args.optimizer or "adam",
        "epochs": args.epochs,
        "strategy": args.strategy,
        "replicas": args.replicas,
        "coordinator": fencing.get("coordinator"),
        "rollbacks": sum(r.get("rollbacks", 0) for r in results),
        "failovers": sum(r.get("failovers", 0) for r in results),
        "server_nodes": servers.node_ids,
        "worker_nodes": [r["node_id"] for r in results],
    }
    say(f"test accuracy {test_acc:.4f} after {summary['steps']} steps per worker in {seconds:.1f}s")
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0


def _write_targets(path: str, targets: list[dict[str, Any]]) -> None:
    """Prometheus file_sd: the scrape targets of this job's actors (see docs/ray.md)."""
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(targets, f, indent=1)
    os.replace(tmp, path)
