"""A ``shardps server`` forked from the fork server against one started fresh (deploy/spawn.py).

    .venv/bin/python benchmarks/spawn.py [--rounds 3] [--json]

Each round starts one server each way, in alternating order, on a free loopback port: forked
(``Spawner.popen``) and fresh (``subprocess.Popen`` of ``python -m shardps server``). For each: the wall
time until its ready line, and the CPU its process has spent 0.2 s after that (from /proc), then it is
stopped with SIGTERM. The fork server's own start (it imports torch once) is printed apart. Ratios are
fresh over forked, medians of this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from shardps.deploy.local import read_ready, stop_processes
from shardps.deploy.spawn import Process, Spawner


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _one(start: callable) -> tuple[float, float]:  # type: ignore[valid-type]
    t0 = time.perf_counter()
    proc: Process = start()
    try:
        read_ready(proc, 120)
        ready = time.perf_counter() - t0
        time.sleep(0.2)  # a fixed settling time, the same for both: what the server spends right after ready
        return ready, _cpu_s(proc.pid)
    finally:
        stop_processes([proc])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    spawner = Spawner().start()
    started = time.perf_counter() - t0
    print(f"fork server ready in {started:.2f} s (pid {spawner.pid})", file=sys.stderr, flush=True)
    rows: dict[str, list[tuple[float, float]]] = {"forked": [], "fresh": []}
    starts = {
        "forked": lambda: spawner.popen(["server", "--port", "0"], env=env),
        "fresh": lambda: subprocess.Popen([sys.executable, "-m", "shardps", "server", "--port", "0"],
                                          stdout=subprocess.PIPE, text=True, env=env, start_new_session=True),
    }
    try:
        for r in range(args.rounds):
            for kind in (("forked", "fresh") if r % 2 == 0 else ("fresh", "forked")):
                ready, cpu = _one(starts[kind])
                rows[kind].append((ready, cpu))
                print(f"round {r + 1}/{args.rounds} {kind}: ready in {ready:.3f} s, {cpu:.2f} CPU-s",
                      file=sys.stderr, flush=True)
    finally:
        spawner.close()
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in rows.items()}
    for k, (ready, cpu) in med.items():
        print(f"{k:7s} ready {ready:.3f} s  {cpu:.2f} CPU-s (medians of {args.rounds})")
    ratio_ready = med["fresh"][0] / med["forked"][0]
    ratio_cpu = med["fresh"][1] / max(med["forked"][1], 0.01)
    print(f"fresh / forked: {ratio_ready:.0f}x the time to ready, {ratio_cpu:.0f}x the CPU "
          f"(CPU read in ticks of 0.01 s)")
    if args.json:
        print(json.dumps({"fork_server_start_s": round(started, 3),
                          "forked_ready_s": round(med["forked"][0], 4), "forked_cpu_s": med["forked"][1],
                          "fresh_ready_s": round(med["fresh"][0], 4), "fresh_cpu_s": med["fresh"][1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
