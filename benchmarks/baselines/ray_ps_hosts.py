"""Ray's object-store parameter server (``ray_ps.py``) across the hosts of a simulated cluster.

A Ray node in every host: the head in the server host (the ``ParameterServer`` actor's), a node in each
worker host (one ``DataWorker`` each), every node started with ``ray start --block`` on the host's own
address, so that weights and gradients cross the shaped links as Ray's object transfers between nodes.
Each node offers a resource named after its host, which pins the actors. The driver runs in the server
host. ``measure`` returns the median step and the CPU seconds every Ray process spent per step.

Run by benchmarks/cluster.py (``--ray-ps``); as ``python ray_ps_hosts.py --driver ...`` it is the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: its helpers

from proccpu import session_cpu  # noqa: E402

PORT = 6380  # every host has an address of its own: a fixed port does


def start_node(net: Any, host: str, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.Popen[str]:
    """``ray start --block`` in ``host``, returned once it printed that its runtime started (its output is read
    to the end by a thread of its own, so the pipe never fills)."""
    proc = net.start(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started = threading.Event()
    said: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            said.append(line)
            if "Ray runtime started" in line:
                started.set()
        started.set()  # it ended: the wait below sees that it did not start

    threading.Thread(target=read, daemon=True, name=f"ray-node-{host}").start()
    if not started.wait(timeout) or proc.poll() is not None:
        raise RuntimeError(f"the Ray node in {host} did not start within {timeout:.0f}s: {''.join(said[-5:])!r}")
    return proc


def measure(net: Any, ps_host: str, worker_hosts: list[str], a: argparse.Namespace,
            counters: Callable[[], tuple[int, int, int]]) -> dict[str, Any]:
    """One row: Ray nodes in ``ps_host`` and ``worker_hosts``, the driver's timed steps, everything stopped.
    ``counters()``: the links' (drops, segments, retransmitted) so far, read around the driver's steps."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
               RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(HERE.parent))
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "1",
           "--object-store-memory", str(256 << 20), "--disable-usage-stats"]
    head = f"{net.host(ps_host)}:{PORT}"
    # A temporary directory of this run's own, one under it per node: the hosts share this machine's /tmp,
    # and Ray's defaults there (/tmp/ray: the sessions' sockets, the "current cluster" address file that a
    # later plain ray.init() would follow to this cluster after it is gone) are not ours to write.
    temp = tempfile.mkdtemp(prefix="rps-", dir="/tmp")
    nodes: list[subprocess.Popen[str]] = []
    driver = None
    try:
        # One node at a time, each once it said it runs.
        nodes.append(start_node(net, ps_host, [*ray, "--head", "--port", str(PORT), "--include-dashboard", "false",
                                               "--node-ip-address", net.host(ps_host), "--temp-dir", f"{temp}/h",
                                               "--resources", json.dumps({ps_host: 1})], env, a.timeout))
        for i, h in enumerate(worker_hosts):
            nodes.append(start_node(net, h, [*ray, "--address", head, "--node-ip-address", net.host(h),
                                             "--temp-dir", f"{temp}/w{i}", "--resources", json.dumps({h: 1})],
                                    env, a.timeout))
        driver = net.start(ps_host, [sys.executable, str(Path(__file__).resolve()), "--driver", "--address", head,
                                     "--ps-host", ps_host, "--worker-hosts", ",".join(worker_hosts),
                                     "--dims", a.dims, "--batch", str(a.batch), "--steps", str(a.steps),
                                     "--warmup", str(a.warmup), "--timeout", str(a.timeout)],
                           env=env, stdout=subprocess.PIPE)
        assert driver.stdout is not None
        first = driver.stdout.readline()
        if '"timed"' not in first:
            raise RuntimeError(f"Ray PS driver said {first!r} instead of starting its timed steps")
        sids = {p.pid for p in nodes} | {driver.pid}
        cpu0, counted0 = session_cpu(sids), counters()
        out, _ = driver.communicate(timeout=a.timeout)
        cpu = (session_cpu(sids) - cpu0) * a.steps / (a.steps + a.warmup)  # the warm-up's share out
        drops, segs, retrans = (b - a for a, b in zip(counted0, counters()))  # warm-up steps too, as shardps'
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{") and '"times"' in ln]
        if driver.returncode != 0 or not lines:
            raise RuntimeError(f"Ray PS driver exited with {driver.returncode}: {out[-500:]!r}")
        times = json.loads(lines[-1])["times"]
    finally:
        for p in ([driver] if driver is not None else []) + nodes[::-1]:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in ([driver] if driver is not None else []) + nodes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
        shutil.rmtree(temp, ignore_errors=True)
    return {"step_s": statistics.median(times), "cpu_s": cpu / len(times), "timeline": None,
            "drops": drops / (a.steps + a.warmup), "retrans_share": retrans / max(1, segs)}


def driver(a: argparse.Namespace) -> int:
    import ray

    from baselines import ray_ps

    dims = tuple(int(d) for d in a.dims.split("-"))
    hosts = a.worker_hosts.split(",")
    deadline = time.monotonic() + a.timeout
    ray.init(address=a.address, log_to_driver=False)
    while len([n for n in ray.nodes() if n["Alive"]]) < len(hosts) + 1:  # every host's node joined
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(ray.nodes())} of {len(hosts) + 1} Ray nodes joined in {a.timeout}s")
        time.sleep(0.2)  # other processes joining: nothing to wait on
    print(json.dumps({"timed": True}), flush=True)
    [times] = ray_ps.run(dims, len(hosts), a.batch, a.warmup + a.steps, timeout=a.timeout,
                         ps_resources={a.ps_host: 0.01}, worker_resources=[{h: 0.01} for h in hosts])
    times = times[a.warmup:]  # the first steps start the actors
    print(json.dumps({"times": times}), flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--driver", action="store_true", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--ps-host", required=True)
    p.add_argument("--worker-hosts", required=True)
    p.add_argument("--dims", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--timeout", type=float, default=600.0)
    sys.exit(driver(p.parse_args()))
