"""``shardps demo``: servers and workers as separate processes on loopback (``shardps sim``: on a NetCluster).

Starts ``--servers`` parameter servers and ``--workers`` workers training the
digits MLP, shows worker 0's progress, then evaluates the weights the
servers hold on the held-out test set. Everything started is stopped on the
way out, Ctrl-C included.

A failover drill: ``--replicas 2 --kill-server 1`` kills server 1 with
SIGKILL once its shard has completed ``--kill-at-step`` steps; its backup on
server 2 (mod N) takes over and the run finishes as if nothing happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from shardps.deploy.lifeline import Lifeline
from shardps.deploy.local import LocalCluster, stop_processes
from shardps.deploy.spawn import Process, spawn
from shardps.protos import env as env_names
from shardps.worker.client import connect

ETCD_PORT = 2379  # shardps sim --coordinator: etcd's client port on its host (the peer port is the next)

Start = Callable[[int, list[str]], Process]
"""How worker k starts, given its ``shardps`` arguments (``_run_workers``)."""


def digits_defaults(args: Any) -> Any:
    """The digits example's defaults of the flags ``demo``'s examples share, where not given (None; the gpt
    example's are its own: deploy/demo_examples.py). Returns ``args``, changed in place."""
    for name, default in (("workers", 2), ("epochs", 10), ("batch_size", 64)):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    return args


def _worker_args(addresses: list[str], k: int, args: Any, backups: list[str] | None = None) -> list[str]:
    """Worker k's ``shardps`` arguments (``worker --example digits ...``)."""
    digits_defaults(args)
    cmd = ["worker", "--example", "digits",
           "--addresses", ",".join(addresses), "--worker-id", str(k), "--num-workers", str(args.workers),
           "--sync", args.sync, "--optimizer", args.optimizer, "--epochs", str(args.epochs),
           "--seed", str(args.seed), "--batch-size", str(args.batch_size), "--wire", getattr(args, "wire", "fp32")]
    if getattr(args, "overlap", False):
        cmd.append("--overlap")
    if getattr(args, "push_window", None) is not None:
        cmd += ["--push-window", str(args.push_window)]
    if getattr(args, "compress", "none") != "none":
        cmd += ["--compress", args.compress, "--compress-warmup", str(args.compress_warmup)]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if backups:
        cmd += ["--backups", ",".join(backups)]
    if k == 0 and not args.quiet:
        cmd.append("--progress")
    return cmd


def _run_workers(addresses: list[str], args: Any, procs: list[Process],
                 kill: Any = None, backups: list[str] | None = None,
                 lifeline: Lifeline | None = None, start: Start | None = None) -> list[dict[str, Any]]:
    """Start the workers (``start``: how worker k starts, stdout a pipe; default: ``spawn``, in a session of its
    own), wait for them, and return each one's JSON result."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in range(args.workers):
        argv = _worker_args(addresses, k, args, backups)
        procs.append(start(k, argv) if start is not None else  # (deploy/spawn.py: forked from the fork server)
                     spawn(argv, env=env, lifeline_fd=lifeline.read_fd if lifeline is not None else None))
    results = []
    deadline = time.monotonic() + args.timeout
    if kill is not None:
        kill()  # the drill: returns once the victim is killed (or the workers ended first)
    for k, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"worker {k} did not finish within {args.timeout:.0f}s") from None
        if p.returncode != 0:
            raise RuntimeError(f"worker {k} failed with exit code {p.returncode}")
        lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
        results.append(json.loads(lines[-1]))
    return results


def _wait_for_version(address: str, version: int, workers: list[Process],
                      deadline: float) -> int | None:
    """Poll one shard until it has reached ``version``: its version then, or None if the workers ended."""
    with connect([address], recovery_timeout=0) as watch:
        while True:
            now = watch.stats()[0]["version"]
            if now >= version:
                return int(now)
            if all(p.poll() is not None for p in workers):
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard at {address} did not reach step {version} in time (at {now})")
            time.sleep(0.01)  # another process's progress: nothing to wait on here


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'shardps[plot]'") from None


def save_plot(path: str, losses: list[list[float]], staleness: dict[int, int], title: str = "") -> None:
    """Loss curve of every worker and the staleness histogram of the run, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for k, ls in enumerate(losses):
        ax1.plot(range(1, len(ls) + 1), ls, label=f"worker {k}", linewidth=0.8)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_yscale("log")
    ax1.set_title(f"loss ({title})")
    ax1.legend()
    xs = sorted(staleness)
    ax2.bar([str(x) for x in xs], [staleness[x] for x in xs], color="tab:orange")
    ax2.set_xlabel("staleness (versions)")
    ax2.set_ylabel("gradients")
    ax2.set_title("gradient staleness, all shards")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _signals_deferred(who: str = "shardps demo") -> Iterator[None]:
    """While stopping children: SIGINT and SIGTERM are noted, not raised (we are stopping already)."""
    def note(signum: int, frame: object) -> None:
        print(f"{who}: signal {signum} while stopping: still stopping", file=sys.stderr, flush=True)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run_demo(args: Any) -> int:
    from shardps.examples.digits import evaluate

    digits_defaults(args)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    procs: list[Process] = []
    if args.plot:
        try:
            _require_matplotlib()
        except RuntimeError as e:
            print(f"shardps demo: {e}", file=sys.stderr)
            return 2
    replicas: int = getattr(args, "replicas", 1)
    victim: int | None = getattr(args, "kill_server", None)
    if victim is not None and not (replicas == 2 and 0 <= victim < args.servers):
        print(f"shardps demo: --kill-server needs --replicas 2 and an index in [0, {args.servers})", file=sys.stderr)
        return 2
    if replicas == 2 and args.servers < 2:
        print("shardps demo: --replicas 2 needs --servers 2 or more", file=sys.stderr)
        return 2
    cluster = LocalCluster(args.servers, processes=True, replicas=replicas)
    lifeline = Lifeline()  # the workers die with this process, even if it is SIGKILLed (the servers too)
    try:
        # Stop children on SIGTERM as on Ctrl-C, from here on (inside the try: a signal that comes at
        # once is handled too). SIGINT explicitly: a process started in the background by a shell
        # without job control inherits SIGINT ignored, and Python then leaves it so.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _interrupt)
        try:
            say(f"shardps demo: {args.servers} servers, {args.workers} workers, sync={args.sync}, "
                f"optimizer={args.optimizer}, {args.epochs} epochs on digits"
                + (", replicas 2" if replicas == 2 else ""))
            cluster.start()
            say(f"servers up at {', '.join(cluster.addresses)}"
                + (f"; backups at {', '.join(cluster.replica_addresses)}" if replicas == 2 else ""))

            def kill() -> None:
                assert victim is not None
                version = _wait_for_version(cluster.addresses[victim], args.kill_at_step, procs,
                                            time.monotonic() + args.timeout)
                if version is None:
                    say(f"the workers ended before server {victim} reached step {args.kill_at_step}: no kill")
                    return
                cluster.kill(victim)
                say(f"killed server {victim} (SIGKILL) at step {version}: its backup takes over")

            try:
                results = _run_workers(cluster.addresses, args, procs, kill if victim is not None else None,
                                       cluster.backup_addresses, lifeline)
            finally:
                with _signals_deferred():
                    stop_processes(procs)  # workers first; the servers still hold the weights
            serving = cluster.serving_addresses()
            test_acc = evaluate(serving, seed=args.seed)
            with connect(serving) as client:
                stats = client.stats()
            if args.plot:
                staleness: dict[int, int] = {}
                for st in stats:
                    for k, v in st["staleness_counts"].items():
                        staleness[k] = staleness.get(k, 0) + v
                save_plot(args.plot, [r["losses"] for r in results], staleness, title=f"{args.sync}, {args.optimizer}")
                say(f"plot saved to {args.plot}")
        finally:
            with _signals_deferred():  # a second Ctrl-C must not cut the clean-up short
                stop_processes(procs)
                cluster.stop()
                lifeline.close()
    except KeyboardInterrupt:
        say("interrupted: stopped the workers and servers")
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"shardps demo failed: {e}", file=sys.stderr, flush=True)
        return 1
    seconds = time.perf_counter() - t0
    summary = _summary(args, results, test_acc, seconds)
    summary.update(replicas=replicas, failovers=sum(r.get("failovers", 0) for r in results),
                   push_received_bytes=sum(st["push_received_bytes_total"] for st in stats))  # measured by the shards
    _report(args, summary, say)
    return 0


def _summary(args: Any, results: list[dict[str, Any]], test_acc: float, seconds: float) -> dict[str, Any]:
    return {
        "test_accuracy": round(test_acc, 4),
        "steps": max(r["steps"] for r in results),
        "pushes_per_worker": max(r["pushes"] for r in results),
        "sync": args.sync,
        "optimizer": args.optimizer,
        "servers": args.servers,
        "workers": args.workers,
        "epochs": args.epochs,
        "seed": args.seed,
        "final_loss": (round(sum(r["final_loss"] for r in trained) / len(trained), 4)
                       if (trained := [r for r in results if r["final_loss"] is not None]) else None),
        "compress": getattr(args, "compress", "none"),
        "seconds": round(seconds, 2),
    }


def _report(args: Any, summary: dict[str, Any], say: Callable[..., None]) -> None:
    say(f"test accuracy {summary['test_accuracy']:.4f} after {summary['steps']} steps per worker "
        f"({summary['pushes_per_worker']} pushes) in {summary['seconds']:.1f}s")
    if args.json:
        print(json.dumps(summary), flush=True)


_EVALUATE = ("import sys; from shardps.examples.digits import evaluate; "
             "print(evaluate(sys.argv[1].split(','), seed=int(sys.argv[2])))")


def run_sim(args: Any) -> int:
    """``shardps sim``: the demo's job on a NetCluster (servers on the first hosts, workers on the next ones)."""
    digits_defaults(args)
    from shardps.deploy.netsim import NetCluster, NetsimUnavailable, format_rate, parse_rate, unavailable

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    reason = unavailable()
    if reason is not None:
        print(f"shardps sim: {reason}", file=sys.stderr)
        return 2
    try:
        net = NetCluster(args.hosts, args.link, links=dict(args.host_link))
    except ValueError as e:
        print(f"shardps sim: {e}", file=sys.stderr)
        return 2
    server_hosts = net.names[:args.servers]
    worker_hosts = net.names[args.servers:args.servers + args.workers]
    t0 = time.perf_counter()
    procs: list[Process] = []
    cleanup = contextlib.ExitStack()
    coordinator: list[str] = []  # the servers' --coordinator flags
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):  # as the demo: stop everything on either
            signal.signal(sig, _interrupt)
        try:
            net.up()
            slow = {h: format_rate(r) for h, r in net.rates.items() if r != parse_rate(args.link)}
            say(f"shardps sim: {args.hosts} hosts on {args.link} links"
                + (f" ({', '.join(f'{h} {r}' for h, r in slow.items())})" if slow else "")
                + f"; servers on {', '.join(server_hosts)}, workers on {', '.join(worker_hosts)}; sync={args.sync}, "
                f"optimizer={args.optimizer}, {args.epochs} epochs on {args.example}")
            # (their warning that they bind a non-loopback address without TLS does not apply: nothing outside
            # this machine's namespaces reaches them)
            env = dict(os.environ)
            env.setdefault(env_names.LOG_LEVEL, "ERROR")
            if args.coordinator:  # etcd on the last host; each server waits for it (--start-timeout) and claims
                from shardps.server.coordinator import etcd_argv

                etcd_host = net.names[-1]
                data = tempfile.mkdtemp(prefix="shardps-sim-etcd-")
                cleanup.callback(shutil.rmtree, data, ignore_errors=True)
                net.start(etcd_host, etcd_argv("etcd", data, net.host(etcd_host), ETCD_PORT, ETCD_PORT + 1),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                coordinator = ["--coordinator", f"etcd://{net.host(etcd_host)}:{ETCD_PORT}", "--job", "sim"]
                say(f"etcd on {etcd_host} at {net.host(etcd_host)}:{ETCD_PORT}: the servers are fenced through it")
            servers = net.start_servers(server_hosts, coordinator, timeout=min(60.0, args.timeout), env=env)
            addresses = [s.address for s in servers]
            say(f"servers up at {', '.join(addresses)}")
            try:
                results = _run_workers(addresses, args, procs, start=lambda k, argv: net.start(
                    worker_hosts[k], [sys.executable, "-m", "shardps", *argv], stdout=subprocess.PIPE))
            finally:
                with _signals_deferred("shardps sim"):
                    stop_processes(procs)
            sent = {h: round(net.traffic(h)[0] / 1e6, 2) for h in server_hosts + worker_hosts}
            done = net.run(worker_hosts[0], [sys.executable, "-c", _EVALUATE, ",".join(addresses), str(args.seed)],
                           timeout=min(120.0, args.timeout))
            test_acc = float(done.stdout.split()[-1])
        finally:
            with _signals_deferred("shardps sim"):
                stop_processes(procs)
                net.close()
                cleanup.close()
    except KeyboardInterrupt:
        say("interrupted: stopped the workers and servers, removed the network")
        return 130
    except NetsimUnavailable as e:
        print(f"shardps sim: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as e:
        print(f"shardps sim failed: {e}", file=sys.stderr, flush=True)
        return 1
    summary = _summary(args, results, test_acc, time.perf_counter() - t0)
    summary.update(hosts=args.hosts, link=args.link, host_links=dict(args.host_link), mb_sent=sent,
                   coordinator=coordinator[1] if coordinator else None)
    _report(args, summary, say)
    return 0
