"""What --replicas 2 costs: push+pull rounds with and without a backup per shard, same run.

    .venv/bin/python benchmarks/replication.py [--params 8e6] [--rounds 10] [--repeats 3] [--sync bsp] [--coordinator]
    .venv/bin/python benchmarks/replication.py --failover [--ttls 2 5]

``--coordinator`` adds a third cluster, ``--replicas 2`` with ``--coordinator``
on a local etcd (Debian's, ``make tools``): what fencing costs a round (the
lease is renewed in the background; a round makes no call to etcd).
``--failover``: the time from a primary's SIGKILL to the first push the new
primary acknowledges (the worker's fail-over included), without a coordinator
and with one at each lease length of ``--ttls`` (seconds).

Starts two clusters of 2 server processes on loopback, one plain and one
with --replicas 2, and one client for each (1 worker, asp, SGD: each push is
applied at once, so a round is: push every gradient, the shards apply it,
forward it to the backup and wait for its confirmation, then pull every
weight, which is served once the backup holds it). The clusters take turns,
--rounds rounds each per repeat, so load on the machine hits both alike.
Prints the median round time of each and the ratio plain / replicated
(1.0: replication is free; 0.5: rounds take twice as long).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any

import torch
from guard import cluster_processes, run_guarded

import shardps
from shardps.deploy.local import LocalCluster
from shardps.server.coordinator import LocalEtcd


def tensors(params: float) -> dict[str, torch.Tensor]:
    """Matrices of 1024 columns (and one odd vector) adding up to about ``params`` elements."""
    rows = max(1, int(params) // (1024 * 8))
    out = {f"w{i}": torch.randn(rows, 1024) for i in range(8)}
    out["bias"] = torch.randn(1000)
    return out


def rounds(client: shardps.PSClient, grads: dict[str, torch.Tensor], first_step: int, n: int) -> list[float]:
    times = []
    for k in range(n):
        t0 = time.perf_counter()
        results = client.push(grads, first_step + k)
        client.pull(min_versions=[r.ready_version for r in results])
        times.append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace, clusters: list[LocalCluster]) -> dict[str, Any]:
    params = tensors(args.params)
    grads = {n: torch.full_like(t, 1e-3) for n, t in params.items()}
    mb = sum(t.numel() for t in params.values()) * 4 / 2**20
    print(f"{mb:.0f} MB of fp32 weights on 2 shards; {args.repeats} x {args.rounds} rounds per cluster",
          file=sys.stderr)
    clusters += [LocalCluster(2, processes=True), LocalCluster(2, processes=True, replicas=2)]
    named = [("plain", clusters[0]), ("replicas 2", clusters[1])]
    if args.coordinator:
        clusters.append(LocalCluster(2, processes=True, replicas=2, coordinator=args.etcd.url, job="bench"))
        named.append(("replicas 2 + coordinator", clusters[2]))
    with contextlib.ExitStack() as started:
        for _, cluster in named:
            started.enter_context(cluster)
        clients = {}
        try:
            for name, cluster in named:
                c = shardps.connect(cluster.addresses, timeout=120)
                clients[name] = c
                c.register(params, shardps.optim.SGD(lr=1e-3), sync=args.sync)
                rounds(c, grads, 0, 2)  # warm-up: connections, buffers
            times: dict[str, list[float]] = {name: [] for name in clients}
            for rep in range(args.repeats):
                for name, c in clients.items():
                    times[name] += rounds(c, grads, 2 + rep * args.rounds, args.rounds)
                print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
                    f"{n} {statistics.median(t[-args.rounds:]) * 1e3:.0f} ms" for n, t in times.items()),
                    file=sys.stderr, flush=True)
            lag = [s["replication_lag_ops"] for s in clients["replicas 2"].stats()]
        finally:
            for c in clients.values():
                c.close()
    med = {n: statistics.median(t) for n, t in times.items()}
    out = {"mb": round(mb, 1), "plain_ms": round(med["plain"] * 1e3, 2),
           "replicated_ms": round(med["replicas 2"] * 1e3, 2), "ratio": round(med["plain"] / med["replicas 2"], 3),
           "replication_lag_ops": lag}
    if "replicas 2 + coordinator" in med:
        out["coordinated_ms"] = round(med["replicas 2 + coordinator"] * 1e3, 2)
        out["coordinator_ratio"] = round(med["replicas 2"] / med["replicas 2 + coordinator"], 3)
    return out


def failover(args: argparse.Namespace, clusters: list[LocalCluster]) -> dict[str, Any]:
    """Per setting: SIGKILL shard 0's primary between two rounds, then time the next push until every shard
    acknowledged it (the worker's fail-over, and with a coordinator the wait for the old lease, included)."""
    params = tensors(1e6)
    grads = {n: torch.full_like(t, 1e-3) for n, t in params.items()}
    settings: list[tuple[str, int | None]] = [("no coordinator", None)] + [(f"coordinator, lease {t}s", t)
                                                                          for t in args.ttls]
    out: dict[str, Any] = {}
    for name, ttl in settings:
        got = []
        for rep in range(args.repeats):
            kw: dict[str, Any] = {}
            if ttl is not None:
                kw = {"coordinator": args.etcd.url, "job": f"failover{ttl}x{rep}", "coordinator_ttl": ttl}
            cluster = LocalCluster(2, processes=True, replicas=2, **kw)
            clusters.append(cluster)
            with cluster:
                with shardps.connect(cluster.addresses, backups=cluster.backup_addresses, timeout=60,
                                     recovery_timeout=120) as c:
                    c.register(params, shardps.optim.SGD(lr=1e-3), sync="asp")
                    rounds(c, grads, 0, 2)
                    cluster.kill(0)
                    t0 = time.perf_counter()
                    c.push(grads, 2)
                    got.append(time.perf_counter() - t0)
                    assert c.failovers_total == 1
            print(f"{name}: kill -> first acknowledged push {got[-1]:.2f} s", file=sys.stderr, flush=True)
        out[name] = {"ttl_s": ttl, "seconds": [round(x, 3) for x in got], "median_s": round(statistics.median(got), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=8e6, help="elements in all (fp32; default 8e6 = 32 MB)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per cluster per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=600.0,
                    help="watchdog: abort the whole run after this many seconds (default 600)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--sync", choices=["asp", "bsp"], default="asp",
                    help="the job's sync mode (bsp: each round is a step through the barrier, its one worker's)")
    ap.add_argument("--coordinator", action="store_true",
                    help="a third cluster: --replicas 2 with --coordinator on a local etcd")
    ap.add_argument("--failover", action="store_true",
                    help="time a primary's SIGKILL to the first acknowledged push, with and without a coordinator")
    ap.add_argument("--ttls", type=int, nargs="+", default=[2, 5], help="--failover: the lease lengths (s)")
    args = ap.parse_args()
    clusters: list[LocalCluster] = []
    with contextlib.ExitStack() as stack:
        args.etcd = stack.enter_context(LocalEtcd()) if args.coordinator or args.failover else None
        if args.failover:
            fo = run_guarded("replication.py", args.max_seconds, lambda: failover(args, clusters),
                             lambda: cluster_processes(clusters))
            if fo is None:
                return 130
            for name, r in fo.items():
                print(f"{name:>24}: kill -> first acknowledged push, median {r['median_s']:.2f} s "
                      f"(runs: {', '.join(f'{x:.2f}' for x in r['seconds'])})")
            if args.json:
                print(json.dumps(fo))
            return 0
        res = run_guarded("replication.py", args.max_seconds, lambda: run(args, clusters),
                          lambda: cluster_processes(clusters))
    if res is None:
        return 130
    for name, key in (("plain", "plain_ms"), ("replicas 2", "replicated_ms")):
        print(f"{name:>11}: round {res[key]:7.1f} ms  ({2 * res['mb'] / res[key] * 1e3:6.0f} MB/s push+pull)")
    print(f"ratio plain / replicated round time: {res['ratio']:.2f}   "
          f"(replication lag after the run: {res['replication_lag_ops']} ops)")
    if "coordinated_ms" in res:
        print(f"replicas 2 + coordinator: round {res['coordinated_ms']:7.1f} ms; ratio replicated / coordinated "
              f"{res['coordinator_ratio']:.2f} (1.0: fencing is free)")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
