#!/usr/bin/env python
"""The CPU of a bsp step's calls on loopback, in the cluster benchmark's layout, and the servers' thread switches.

    .venv/bin/python benchmarks/call_cpu.py [--shards-per-host 1 4 16] [--steps 20] [--rounds 2] [--shm]

benchmarks/cluster.py's workload and schedule without its links: 4 server
processes (``shardps server --shards S``), 4 workers
(``baselines/host_worker.py``: the MLP 1024-2048-1024-10, batch 8, SGD,
bsp, a window of 4, the model cut into parts of a shard's size), every
process on this machine's loopback, ``SHARDPS_SHM=0`` so that the bytes
take the data connection as between hosts (``--shm``: through shared memory,
as on one machine, the calls still frames on the connection). Each worker pushes and pulls
every shard once a step: 2 x 4 S x 4 calls a step. Printed per S (medians
over ``--rounds``, rounds rotating): the step (on loopback every process
shares the machine's cores, so the step is the CPU's bound), the CPU
seconds a step of the workers and of the servers, the CPU a call (both
ends), and the servers' context switches a call (voluntary and not, summed
over their threads, from /proc/PID/task/*/status; a thread that ends in
between takes its count with it). A switch is a thread that stopped and
another that ran: in these processes mostly threads handing the
interpreter's lock and their work to each other.

``--systems shardps,raw-parts,raw-parts-c``: beside shardps, the same
schedule on raw sockets (``baselines/raw_ps.py --parts``: nothing but the
work, its per-part loop in Python) and ``raw-parts-c``, the same with that
loop in C on both ends (``raw_ps.py --parts --native``, built with gcc by
``baselines/native.py`` before the first run); ``raw-parts-c-pystep``, the
same with each part's sum and step a call into Python on the server
(``--py-step``: a compiled loop that keeps its optimizers in torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baselines.common import numel  # noqa: E402
from cluster import parse_ready, read_ready_lines  # noqa: E402
from proccpu import process_cpu  # noqa: E402

HOSTS, WORKERS = 4, 4
DIMS = (1024, 2048, 1024, 10)


def switches(pid: int) -> int:
    """Context switches so far, summed over the process's live threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                    total += int(line.split()[1])
        except OSError:
            continue  # ended in between
    return total


def one(per: int, steps: int, timeout: float, shm: bool = False, system: str = "shardps") -> dict[str, Any]:
    """One run at ``per`` shards (``raw-parts``: parts) a server process: start, time ``steps`` steps after 2,
    stop."""
    env = dict(os.environ, SHARDPS_LOG_LEVEL="ERROR", SHARDPS_SHM="1" if shm else "0")
    total = HOSTS * per
    servers: list[subprocess.Popen[str]] = []
    workers: list[subprocess.Popen[str]] = []
    try:
        if system.startswith("raw-parts"):  # baselines/raw_ps.py --parts: the schedule, nothing but the work
            flat = numel(DIMS)
            native = ["--native"] if system.startswith("raw-parts-c") else []
            pystep = ["--py-step"] if system == "raw-parts-c-pystep" else []
            for j in range(HOSTS):
                servers.append(subprocess.Popen(
                    [sys.executable, str(HERE / "baselines" / "raw_ps.py"), "--host", "127.0.0.1", "--world",
                     str(WORKERS), "--lo", str(flat * j // HOSTS), "--hi", str(flat * (j + 1) // HOSTS),
                     "--steps", str(steps + 2), "--timeout", str(timeout), "--parts", str(per), *native, *pystep],
                    env=env, stdout=subprocess.PIPE, text=True))
            addresses = []
            for proc in servers:
                line = proc.stdout.readline() if proc.stdout else ""
                if not line.startswith("READY "):
                    raise RuntimeError(f"raw-parts: a server said {line!r} instead of READY")
                addresses.append(line.split()[1])
            argv = ["raw-ps", "--parts", str(per), *native]
        else:
            for j in range(HOSTS):
                servers.append(subprocess.Popen(
                    [sys.executable, "-m", "shardps", "server", "--host", "127.0.0.1", "--port", "0",
                     "--shard-index", str(j * per), "--shards", str(per), "--num-shards", str(total)],
                    env=env, stdout=subprocess.PIPE, text=True))
            addresses = [parse_ready(line)[0] for s in servers for line in read_ready_lines(s, 120, per)]
            argv = ["shardps", "--part-bytes", str(4 * numel(DIMS) // total)]
        for r in range(WORKERS):
            workers.append(subprocess.Popen(
                [sys.executable, str(HERE / "baselines" / "host_worker.py"), *argv, "--rank", str(r),
                 "--world", str(WORKERS), "--steps", str(steps), "--warmup", "2", "--timeout", str(timeout),
                 "--addresses", ",".join(addresses), "--window", "4"],
                env=env, stdout=subprocess.PIPE, text=True))
        first = workers[0].stdout.readline() if workers[0].stdout else ""
        if '"timed"' not in first:
            raise RuntimeError(f"worker 0 said {first!r} instead of starting its timed steps")
        cpu0 = sum(process_cpu(s.pid) for s in servers)
        sw0 = sum(switches(s.pid) for s in servers)
        deadline = time.monotonic() + timeout
        results = []
        for w in workers:
            out, _ = w.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [ln for ln in out.splitlines() if '"times"' in ln]
            if w.returncode != 0 or not lines:
                raise RuntimeError(f"a worker exited with {w.returncode}: {out[-500:]!r}")
            results.append(json.loads(lines[-1]))
        server_cpu = (sum(process_cpu(s.pid) for s in servers) - cpu0) / steps
        # (raw-parts: its serving threads end with the last step and take their counts with them)
        server_sw = (sum(switches(s.pid) for s in servers) - sw0) / steps if system == "shardps" else None
    finally:
        for p in workers + servers:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
    calls = 2 * total * WORKERS
    worker_cpu = sum(r["cpu_s"] for r in results) / steps
    return {"system": system, "per": per, "calls_per_step": calls, "step_s": statistics.median(results[0]["times"]),
            "worker_cpu_s": worker_cpu, "server_cpu_s": server_cpu,
            "cpu_ms_per_call": (worker_cpu + server_cpu) / calls * 1e3,
            "server_switches_per_call": server_sw / calls if server_sw is not None else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards-per-host", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--shm", action="store_true", help="the bytes through shared memory (one machine's path)")
    p.add_argument("--systems", default="shardps",
                   help="comma-separated: shardps, raw-parts (baselines/raw_ps.py --parts: the same schedule of "
                        "parts in Python with nothing but the work, a floor to set shardps beside), raw-parts-c "
                        "(the same, its per-part loop in C: --native), raw-parts-c-pystep (that, each part's sum "
                        "and step a call into Python)")
    a = p.parse_args()
    systems = [x.strip() for x in a.systems.split(",") if x.strip()]
    known = ("shardps", "raw-parts", "raw-parts-c", "raw-parts-c-pystep")
    if not systems or any(x not in known for x in systems):
        p.error(f"--systems: expected some of {', '.join(known)}, got {a.systems!r}")
    if any(x.startswith("raw-parts-c") for x in systems):
        from baselines.native import NativeUnavailable, build

        try:
            build()  # once, before any run starts its processes
        except NativeUnavailable as e:
            p.error(str(e))
    print(f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {HOSTS} server processes, {WORKERS} workers, "
          f"{a.steps} timed steps after 2; bytes through {'shared memory' if a.shm else 'the data connection'}",
          file=sys.stderr)
    cases = [(system, per) for per in a.shards_per_host for system in systems]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in cases}
    for r in range(a.rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        for system, per in order:
            row = one(per, a.steps, a.timeout, a.shm, system)
            print(f"  [round {r + 1}/{a.rounds}] {system}, {per} shards a process: {row['step_s'] * 1e3:.0f} ms "
                  f"a step, {row['cpu_ms_per_call']:.2f} CPU-ms a call", file=sys.stderr)
            runs[(system, per)].append(row)
    rows = [{k: (rs[0][k] if k == "system" or rs[0][k] is None else round(statistics.median(x[k] for x in rs), 4))
             for k in rs[0]} for rs in runs.values()]
    if a.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print("| system | shards a server process | calls a step | step ms | workers' CPU s/step | servers' CPU s/step | "
          "CPU ms a call | servers' switches a call |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['per']:.0f} | {row['calls_per_step']:.0f} | {row['step_s'] * 1e3:.0f} | "
              f"{row['worker_cpu_s']:.3f} | {row['server_cpu_s']:.3f} | {row['cpu_ms_per_call']:.2f} | "
              f"{'-' if row['server_switches_per_call'] is None else format(row['server_switches_per_call'], '.0f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
