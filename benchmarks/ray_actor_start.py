"""What one Ray actor costs to start, and what a driver's ``runtime_env`` adds to it.

    sudo .venv/bin/python benchmarks/ray_actor_start.py [--actors 8] [--rounds 2] [--json]

A cluster's actors need a module path the nodes' Python does not have (the
tests' training loops, a user's own code beside the job). Two ways to give it:

- ``runtime_env``: ``ray.init(runtime_env={"env_vars": {"PYTHONPATH": ...}})``,
  every worker of the job started through Ray's ``setup_worker.py`` (a Python
  and a Ray import before the worker's own) after the runtime-env agent has
  built its environment;
- ``node_env``: the same variable in the nodes' own environment
  (``RayLocalCluster(node_env=...)``, or set before ``ray start``), which
  every worker inherits.

For each, alternating, a head of 4 CPUs (``RayLocalCluster``) and
``--rounds`` rounds of ``--actors`` actors (half a CPU each) that import
torch, shardps and a module found only on that path; the CPU seconds of
every process of the run (a cpuacct cgroup of its own: Ray's daemons, the
agents and the actors, counted whether they exit or are killed) from the
first actor asked for to the last ready, and the wall time. Then the idle
cluster's CPU over ``--idle`` seconds. Prints medians per actor and the
ratio runtime_env / node_env. Needs root (a cgroup of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guard import run_guarded  # noqa: E402

PROBE = "shardps_bench_probe"


class CpuGroup:
    """A cpuacct cgroup (v1) or a cgroup of its own (v2) holding this process and its children."""

    def __init__(self) -> None:
        v1 = Path("/sys/fs/cgroup/cpuacct")
        name = f"shardps-bench-{os.getpid()}"
        self.v2 = not v1.is_dir()
        self.path = (Path("/sys/fs/cgroup") if self.v2 else v1) / name
        self.parent = self.path.parent
        try:
            self.path.mkdir()
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            raise SystemExit(f"ray_actor_start: needs root, to make a cgroup of its own ({self.path}: {e})") from None

    def seconds(self) -> float:
        if self.v2:
            usage = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
            return int(usage["usage_usec"]) / 1e6
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except OSError:  # a killed worker not reaped yet
                time.sleep(0.2)
        print(f"ray_actor_start: {self.path} still has processes; left in place", file=sys.stderr)


def measure_variant(variant: str, path: str, args: argparse.Namespace, cg: CpuGroup, say: Any) -> dict[str, Any]:
    import ray

    from shardps.ray import RayLocalCluster

    out: dict[str, Any] = {"actor_cpu_s": [], "actor_wall_s": []}
    node_env = {"PYTHONPATH": path} if variant == "node_env" else {}
    with RayLocalCluster(num_cpus=4, node_env=node_env) as rc:
        if variant == "node_env":
            ray.init(address=rc.address, log_to_driver=False)
        else:
            ray.init(address=rc.address, runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
        try:
            @ray.remote(num_cpus=0.5)
            class Probe:
                def ready(self) -> int:
                    import importlib

                    import torch  # noqa: F401

                    import shardps.ray  # noqa: F401
                    importlib.import_module(PROBE)  # only on the path given
                    return os.getpid()

            for r in range(args.rounds):
                c0, t0 = cg.seconds(), time.monotonic()
                actors = [Probe.remote() for _ in range(args.actors)]  # type: ignore[attr-defined]
                ray.get([a.ready.remote() for a in actors], timeout=300)
                cpu, wall = cg.seconds() - c0, time.monotonic() - t0
                for a in actors:
                    ray.kill(a)
                out["actor_cpu_s"].append(cpu / args.actors)
                out["actor_wall_s"].append(wall)
                say(f"{variant} round {r + 1}: {args.actors} actors in {wall:.1f}s, "
                    f"{cpu / args.actors:.2f} CPU-s each")
            time.sleep(5)  # the killed actors' workers exit: not part of the idle figure
            c0 = cg.seconds()
            time.sleep(args.idle)
            out["idle_cpu_s"] = cg.seconds() - c0
            say(f"{variant} idle: {out['idle_cpu_s']:.2f} CPU-s in {args.idle:.0f}s")
        finally:
            ray.shutdown()
    return out


def measure(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    cg = CpuGroup()
    try:
        with tempfile.TemporaryDirectory(prefix="shardps-probe-") as path:
            Path(path, f"{PROBE}.py").write_text("VALUE = 1\n")
            runs: dict[str, list[dict[str, Any]]] = {"node_env": [], "runtime_env": []}
            for rep in range(args.repeats):
                order = ("node_env", "runtime_env") if rep % 2 == 0 else ("runtime_env", "node_env")
                for variant in order:
                    runs[variant].append(measure_variant(variant, path, args, cg, say))
    finally:
        cg.close()
    out: dict[str, Any] = {"actors": args.actors, "rounds": args.rounds, "repeats": args.repeats}
    for variant, rs in runs.items():
        out[variant] = {
            "actor_cpu_s": statistics.median(x for r in rs for x in r["actor_cpu_s"]),
            "actors_wall_s": statistics.median(x for r in rs for x in r["actor_wall_s"]),
            "idle_cpu_s": statistics.median(r["idle_cpu_s"] for r in rs),
        }
    out["actor_cpu_ratio"] = out["runtime_env"]["actor_cpu_s"] / out["node_env"]["actor_cpu_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=8, help="actors started at once, each round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of actors on each cluster")
    p.add_argument("--repeats", type=int, default=1, help="clusters of each kind, alternating")
    p.add_argument("--idle", type=float, default=30.0, help="seconds of the idle cluster measured")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=900.0)
    args = p.parse_args()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out = run_guarded("ray_actor_start", args.max_seconds, lambda: measure(args, say), lambda: [])
    if out is None:
        return 130
    if args.json:
        print(json.dumps(out))
        return 0
    for variant in ("node_env", "runtime_env"):
        v = out[variant]
        print(f"{variant:12s} {v['actor_cpu_s']:.2f} CPU-s an actor ({args.actors} at once: "
              f"{v['actors_wall_s']:.1f}s to all ready); idle cluster {v['idle_cpu_s']:.2f} CPU-s in "
              f"{args.idle:.0f}s")
    print(f"runtime_env / node_env, CPU an actor: {out['actor_cpu_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
