#!/usr/bin/env python
"""The parameter server against ring all-reduce on a simulated cluster, where bandwidth decides.

    sudo .venv/bin/python benchmarks/cluster.py [--links 500mbit 200mbit] [--rounds 2] [--json]
    sudo .venv/bin/python benchmarks/cluster.py --quick            # DDP, raw PS, shardps bsp fp32, n = 4, k = 4
    sudo .venv/bin/python benchmarks/cluster.py --quick --links 50mbit   # where the link, not the CPU, is the bound
    sudo .venv/bin/python benchmarks/cluster.py --plot hosts.png --timeline step.png

One ``shardps.netsim.NetCluster`` of 8 hosts (4 worker hosts h0-h3, 4 server
hosts h4-h7), every link shaped to the same rate, and on it, in one run and
in rotating order, the systems compared: DDP over gloo (ring
all-reduce) on n = 2 and 4 worker hosts; a parameter server on raw
sockets (``baselines/raw_ps.py``: the same placement and bytes as shardps's
with 4 server hosts, one message a worker and server a step, nothing else:
the CPU floor of a parameter server in Python); shardps bsp with k = 0 (a server on
each worker host), 2 and 4 server hosts, fp32, bf16 both ways, and
every:4. The workload (``baselines/common.py``): an MLP ``--dims``
(default 1024-2048-1024-10, 4.2M parameters, M = 16.8 MB in fp32), batch 8
per worker, SGD, one torch thread per worker
(``baselines/host_worker.py``: one process per host).

shardps runs the partitioned schedule: each server host serves
``--shards-per-host`` shards (``shardps server --shards``), and each worker
pushes them ``--window`` at a time (``DistributedOptimizer(push_window=)``),
each shard's pull riding its push's frame, made by the server as soon as
the push is taken in; the row "bsp fp32,
1 shard a host, all at once" is the schedule before it.

Beside each measured step (the median over workers of each worker's median
timed step; under every:4, of each worker's mean over whole rounds of 4),
the time BytePS's analysis gives for that configuration, with M the bytes
on the wire, B the link rate, n workers and k server hosts:
ring all-reduce 2(n-1)/n * M/B; a parameter server on k separate hosts
max(M/B, n*M/(k*B)); servers on the worker hosts (k = 0) 2(n-1)/n * M/B;
every:4 a quarter of bsp's; top-k sends values and indices up (2 x ratio
x M) and pulls dense weights (M), so its bound is the pull's M/B. The ratio measured / formula is what is left
to explain (framing, Python, the step, and on this machine the CPU: every
host shares the same 2 cores, so ``cpu/step``, the CPU seconds every
process of the row spent per step, over the cores, is a floor no link can
lift; it is printed beside).

``--ray-ps``: Ray's object-store parameter server (baselines/ray_ps.py: one
``ParameterServer`` actor, ``DataWorker`` actors) with a Ray node in every
host (baselines/ray_ps_hosts.py), beside DDP and shardps at n = 4 with 4
server hosts and with 1 (Ray's own: one actor in one host); its formula is
a parameter server's with k = 1.

``--sweep``: shards a server host (1, 2, 4, 8) against the window (all at once, 1-4), n = 4, k = 4,
beside DDP: what the defaults were chosen from. ``--grid 8/4 16/4/library``: the same at chosen PER/WINDOW
settings. The model is cut into parts of a shard's size (``connect(part_bytes=)``: a shard holds one piece of
a tensor, so a call moves one piece); ``/library`` (``--library-parts`` for every row): the library's cut, up
to 16 pieces a shard of at least 256 KiB, each a frame, a message and a step of its own on the shard.

``--raw-parts`` (with ``--quick``, ``--grid``, ...): beside each shardps row of 4 server hosts and a window,
the raw parameter server cut into the same parts (``baselines/raw_ps.py --parts``: each part a 4-byte number
and its bytes, the same window of parts unanswered, the checks, the sum and the step; no control messages,
versions or answers to pushes): what that granularity costs a parameter server in Python with nothing but the
work, in the same run. ``--native-parts``: the same rows with the per-part loop in C on both ends
(``raw_ps.py --parts --native``, built with gcc by ``baselines/native.py`` before the first row): what the
same granularity costs once that loop is out of the interpreter.

``--json``: one object per row (``system``, ``sync``, ``wire``, ``n``,
``k``, ``whole``, ``link_mbit``, ``model_mb``, ``step_s``, ``formula_s``, ``cpu_s``, ``compute_s`` (shardps rows;
DDP's backward holds its all-reduce): a worker's forward and backward (the median of every worker's timed
steps), ``slowest_compute_s``: the slowest worker's in each step (their median; under bsp the first round's
weights wait for that worker's first push), ``drops_per_step``: packets the
links' tbf queues dropped, ``retrans_share``: the share of the hosts' TCP segments that were retransmissions,
``machine_busy``, ``machine_softirq``, ``machine_system``, ``machine_steal``: shares of the whole machine's
cores over the timed steps, from /proc/stat: busy (all but idle), the kernel's packet work, the kernel's
other work, the time the virtual machine's cores waited for their host).
Needs root (network namespaces): it says so in one line otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baselines.common import numel  # noqa: E402
from clusterplots import plot, plot_timeline  # noqa: E402
from proccpu import machine_cpu, machine_shares, process_cpu  # noqa: E402

from shardps.deploy.local import parse_ready, read_ready_lines  # noqa: E402
from shardps.netsim import NetCluster, parse_rate, unavailable  # noqa: E402

WORKER_HOSTS = ["h0", "h1", "h2", "h3"]
SERVER_HOSTS = ["h4", "h5", "h6", "h7"]


@dataclass(frozen=True)
class Config:
    system: str  # "ddp", "shardps", "raw-ps" or "ray-ps"
    n: int
    k: int = 0  # server hosts (0: a server on each worker host)
    sync: str = "bsp"
    wire: str = "fp32"
    per: int = 1  # shards a server host serves
    window: int | None = None  # push_window
    compress: str = "none"  # shardps.compress spec (topk:0.01)
    whole: bool = True  # parts of a shard's size (connect(part_bytes=)): one piece of a tensor a shard
    native: bool = False  # raw-ps: the per-part loop in C (raw_ps.py --native)

    @property
    def label(self) -> str:
        if self.system == "ddp":
            return "DDP (gloo ring all-reduce)"
        if self.system == "ray-ps":
            return "Ray object-store PS (one actor, 1 server host)"
        if self.system == "raw-ps" and self.native:
            return (f"raw sockets PS in C, {self.k} server hosts, {self.per} parts a host, window {self.window} "
                    f"(shardps's parts, their loop compiled)")
        if self.system == "raw-ps" and self.per > 1:
            return (f"raw sockets PS, {self.k} server hosts, {self.per} parts a host, window {self.window} "
                    f"(shardps's parts: their floor in Python)")
        if self.system == "raw-ps":
            return f"raw sockets PS, {self.k} server hosts, one message a worker and server (the CPU floor)"
        where = "servers on the worker hosts" if self.k == 0 else f"{self.k} server hosts"
        how = (f"{self.per} shards a host, window {self.window}" if self.window
               else f"{self.per} shard a host, all at once")
        wire = self.wire if self.compress == "none" else f"{self.wire} {self.compress}"
        return f"shardps {self.sync} {wire}, {where}, {how}" + ("" if self.whole else ", the library's parts")


def configs(quick: bool, per: int, window: int, sweep: bool = False, ray_ps: bool = False,
            bf16: bool = False, grid: list[tuple[int, int, bool]] | None = None,
            raw_parts: bool = False, native_parts: bool = False) -> list[Config]:
    out = _configs(quick, per, window, sweep, ray_ps, bf16, grid)
    # the raw server with shardps's parts: at each shards-a-host/window setting of a shardps row
    settings = dict.fromkeys((c.per, c.window) for c in out if c.system == "shardps" and c.k == 4 and c.window)
    if native_parts:
        out[1:1] = [Config("raw-ps", 4, 4, per=p, window=w, native=True) for p, w in settings]
    if raw_parts:
        out[1:1] = [Config("raw-ps", 4, 4, per=p, window=w) for p, w in settings if p > 1]
    return out


def _configs(quick: bool, per: int, window: int, sweep: bool, ray_ps: bool, bf16: bool,
             grid: list[tuple[int, int, bool]] | None) -> list[Config]:
    if grid:  # chosen settings of the schedule beside DDP
        return [Config("ddp", 4)] + [Config("shardps", 4, 4, per=p, window=w, whole=h) for p, w, h in grid]
    if ray_ps:  # Ray's documented parameter server beside DDP and shardps at n = 4
        return [Config("ddp", 4), Config("shardps", 4, 4, per=per, window=window),
                Config("shardps", 4, 1, per=per, window=window), Config("ray-ps", 4, 1)]
    if sweep:
        return [Config("ddp", 4)] + [Config("shardps", 4, 4, per=p, window=w)
                                     for p in (1, 2, 4, 8) for w in (None, 1, 2, 3, 4) if not (w and w >= 4 * p)]
    if quick:
        return [Config("ddp", 4), Config("raw-ps", 4, 4), Config("shardps", 4, 4, per=per, window=window)] + (
            [Config("shardps", 4, 4, wire="bf16", per=per, window=window)] if bf16 else [])
    return [Config("ddp", 2), Config("ddp", 4), Config("raw-ps", 4, 4),
            Config("shardps", 4, 4),  # before the partitioned schedule
            Config("shardps", 4, 0, per=per, window=window),
            Config("shardps", 4, 2, per=per, window=window),
            Config("shardps", 4, 4, per=per, window=window),
            Config("shardps", 4, 4, wire="bf16", per=per, window=window),
            Config("shardps", 4, 4, sync="every:4", per=per, window=window),
            Config("shardps", 4, 4, compress="topk:0.01", per=per, window=window),
            Config("shardps", 2, 2, per=per, window=window)]


def formula(c: Config, model_bytes: float, bits_per_s: float) -> float:
    """BytePS's step time for ``c`` (see the module docstring), in seconds."""
    m = model_bytes * (0.5 if c.wire == "bf16" else 1.0)
    if c.compress.startswith("topk:"):  # values and int32 indices go up; the weights come down dense
        up = m * float(c.compress.partition(":")[2]) * 2
        b = bits_per_s / 8
        return max(up, m, c.n * m / c.k) / b if c.k else 2 * (c.n - 1) / c.n * m / b
    b = bits_per_s / 8
    if c.system == "ddp" or c.k == 0:
        t = 2 * (c.n - 1) / c.n * m / b
    else:
        t = max(m / b, c.n * m / (c.k * b))
    return t / 4 if c.sync == "every:4" else t


def accumulation(sync: str) -> int:
    """X of every:X (1 for the other modes)."""
    return int(sync.partition(":")[2]) if sync.startswith("every:") else 1


def link_counters(net: NetCluster, hosts: list[str]) -> tuple[int, int, int]:
    """Packets the links' tbf queues dropped (both ends of every host's link), and the TCP segments the
    hosts sent and retransmitted, so far: (drops, segments, retransmitted)."""
    drops = segs = retrans = 0
    for ns in [net.netns(h) for h in hosts] + [net.bridge_netns]:
        out = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        drops += sum(int(x) for x in re.findall(r"dropped (\d+)", out))
    for h in hosts:
        snmp = subprocess.run(["ip", "netns", "exec", net.netns(h), "cat", "/proc/net/snmp"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.splitlines()
        names, values = (line.split()[1:] for line in snmp if line.startswith("Tcp:"))
        tcp = dict(zip(names, values))
        segs, retrans = segs + int(tcp["OutSegs"]), retrans + int(tcp["RetransSegs"])
    return drops, segs, retrans


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def measure(net: NetCluster, c: Config, a: argparse.Namespace, timeline: bool) -> dict[str, Any]:
    """One row: start the servers (shardps), the workers, wait for their results, stop everything."""
    if c.system == "ray-ps":
        from baselines import ray_ps_hosts

        return ray_ps_hosts.measure(net, SERVER_HOSTS[0], WORKER_HOSTS[:c.n], a,
                                    lambda: link_counters(net, WORKER_HOSTS + SERVER_HOSTS))
    env = dict(os.environ, SHARDPS_LOG_LEVEL="ERROR")
    servers: list[subprocess.Popen[str]] = []
    addresses: list[str] = []
    workers: list[subprocess.Popen[str]] = []
    counted0 = link_counters(net, WORKER_HOSTS + SERVER_HOSTS)
    try:
        if c.system == "shardps":
            hosts = WORKER_HOSTS[:c.n] if c.k == 0 else SERVER_HOSTS[:c.k]
            total = len(hosts) * c.per
            for j, h in enumerate(hosts):
                servers.append(net.start(h, [sys.executable, "-m", "shardps", "server", "--host", net.host(h),
                                             "--port", "0", "--shard-index", str(j * c.per), "--shards",
                                             str(c.per), "--num-shards", str(total)], env=env,
                                         stdout=subprocess.PIPE))
            for proc in servers:
                addresses += [parse_ready(line)[0] for line in read_ready_lines(proc, 120, c.per)]
        every = accumulation(c.sync)
        steps, warmup = -(-a.steps // every) * every, -(-a.warmup // every) * every  # whole sync rounds
        if c.system == "raw-ps":  # one process a server host, each a contiguous 1/k of the flat model
            total = numel(_dims(a.dims))
            for j, h in enumerate(SERVER_HOSTS[:c.k]):
                servers.append(net.start(h, [sys.executable, str(HERE / "baselines" / "raw_ps.py"), "--host",
                                             net.host(h), "--world", str(c.n), "--lo", str(total * j // c.k),
                                             "--hi", str(total * (j + 1) // c.k), "--steps", str(steps + warmup),
                                             "--timeout", str(a.timeout), "--parts", str(c.per),
                                             *(["--native"] if c.native else [])], env=env,
                                         stdout=subprocess.PIPE))
            for proc in servers:
                line = proc.stdout.readline() if proc.stdout else ""
                if not line.startswith("READY "):
                    raise RuntimeError(f"{c.label}: a server said {line!r} instead of READY")
                addresses.append(line.split()[1])
        for r in range(c.n):
            argv = [sys.executable, str(HERE / "baselines" / "host_worker.py"), c.system, "--rank", str(r),
                    "--world", str(c.n), "--dims", a.dims, "--batch", str(a.batch), "--steps", str(steps),
                    "--warmup", str(warmup), "--timeout", str(a.timeout)]
            if c.system == "ddp":
                argv += ["--master", f"{net.host(WORKER_HOSTS[0])}:29500"]
            elif c.system == "raw-ps":
                argv += ["--addresses", ",".join(addresses), "--parts", str(c.per)]
                argv += ["--window", str(c.window)] if c.window and (c.per > 1 or c.native) else []
                argv += ["--native"] if c.native else []
            else:
                argv += ["--addresses", ",".join(addresses), "--sync", c.sync, "--wire", c.wire]
                argv += ["--window", str(c.window)] if c.window else []
                argv += ["--compress", c.compress]
                argv += ["--part-bytes", str(4 * numel(_dims(a.dims)) // total)] if c.whole else []
            if timeline and r == 0:
                argv.append("--timeline")
            workers.append(net.start(WORKER_HOSTS[r], argv, env=env, stdout=subprocess.PIPE))
        deadline = time.monotonic() + a.timeout
        first = workers[0].stdout.readline() if workers[0].stdout else ""
        if '"timed"' not in first:
            raise RuntimeError(f"{c.label}: worker 0 said {first!r} instead of starting its timed steps")
        server_cpu0, machine0 = sum(process_cpu(p.pid) for p in servers), machine_cpu()
        results = []
        for w in workers:
            out, _ = w.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [ln for ln in out.strip().splitlines() if ln.startswith("{") and '"times"' in ln]
            if w.returncode != 0 or not lines:
                raise RuntimeError(f"{c.label}: a worker exited with {w.returncode}: {out[-500:]!r}")
            results.append(json.loads(lines[-1]))
        server_cpu = sum(process_cpu(p.pid) for p in servers) - server_cpu0
        machine = machine_shares(machine0, machine_cpu())
    finally:
        for p in workers + servers:
            stop(p)
    # every:X syncs one step in X: its step is the mean over whole rounds; the others' the median
    per_worker = statistics.mean if every > 1 else statistics.median
    step = statistics.median(per_worker(r["times"]) for r in results)
    cpu = (sum(r["cpu_s"] for r in results) + server_cpu) / steps
    # shardps: forward + backward, the median of every worker's steps, and the median over steps of the
    # slowest worker's (a barrier's first round waits for the last worker's first push). Not DDP's: its
    # backward holds its all-reduce.
    timed: dict[str, float] = {}
    if c.system == "shardps":
        timed["compute_s"] = statistics.median(t for r in results for t in r["compute"])
        timed["slowest_compute_s"] = statistics.median(max(ts) for ts in zip(*(r["compute"] for r in results)))
    # the links' counters over the whole row (warm-up steps too), per step
    drops, segs, retrans = (b - a for a, b in zip(counted0, link_counters(net, WORKER_HOSTS + SERVER_HOSTS)))
    return {"step_s": step, "cpu_s": cpu, "timeline": results[0].get("timeline"), **timed,
            "drops": drops / (steps + warmup), "retrans_share": retrans / max(1, segs),
            "busy": machine["busy"], "softirq": machine["softirq"], "system": machine["system"],
            "steal": machine["steal"]}


def row(c: Config, got: list[dict[str, Any]], model_bytes: float, bits: float) -> dict[str, Any]:
    step = statistics.median(g["step_s"] for g in got)
    f = formula(c, model_bytes, bits)
    out = {"system": c.system, **{k: v for k, v in asdict(c).items() if k != "system"}, "label": c.label,
           "link_mbit": round(bits / 1e6), "model_mb": round(model_bytes / 1e6, 2), "step_s": round(step, 4),
           "formula_s": round(f, 4), "ratio": round(step / f, 3),
           "cpu_s": round(statistics.median(g["cpu_s"] for g in got), 3),
           **{k: round(statistics.median(g[k] for g in got if k in g), 4)
              for k in ("compute_s", "slowest_compute_s") if any(k in g for g in got)},
           "drops_per_step": round(statistics.median(g["drops"] for g in got)),
           "retrans_share": round(statistics.median(g["retrans_share"] for g in got), 4),
           **{f"machine_{k}": round(statistics.median(g[k] for g in got), 3)
              for k in ("busy", "softirq", "system", "steal")}}
    return out


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("-"))


def _setting(text: str) -> tuple[int, int, bool]:  # --grid's PER/WINDOW[/library]
    per, window, *rest = text.split("/") + [""]
    if per.isdigit() and window.isdigit() and int(per) > 0 and int(window) > 0 and rest[0] in ("", "library"):
        return int(per), int(window), rest[0] != "library"
    raise argparse.ArgumentTypeError(f"{text!r}: expected PER/WINDOW or PER/WINDOW/library, two positive numbers")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", nargs="+", help="link rates, one table each (default 500mbit 200mbit; --quick: 200mbit)")
    p.add_argument("--dims", default="1024-2048-1024-10")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per worker")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="each row this many times, in rotating order")
    p.add_argument("--shards-per-host", type=int, default=16,
                   help="shards each server host serves "
                        "(default 16: the best at 200 Mbit/s, docs/history/performance-log.md)")
    p.add_argument("--window", type=int, default=4, help="pushes going at once (default 4)")
    p.add_argument("--timeout", type=float, default=600.0, help="per row, seconds")
    p.add_argument("--quick", action="store_true",
                   help="only DDP, the raw sockets PS and shardps bsp fp32 at n = 4, k = 4 (200mbit)")
    p.add_argument("--bf16", action="store_true", help="with --quick: shardps bsp bf16 at n = 4, k = 4 too")
    p.add_argument("--sweep", action="store_true",
                   help="the schedule's settings instead: shards a host 1-8 x window 1-4 (n = 4, k = 4), and DDP")
    p.add_argument("--library-parts", action="store_true",
                   help="the library's cut of the model (up to 16 parts a shard, at least 256 KiB each) instead of "
                        "parts of a shard's size (connect(part_bytes=model bytes / shards), the default)")
    p.add_argument("--grid", nargs="+", type=_setting, metavar="PER/WINDOW[/library]",
                   help="shardps bsp fp32 (n = 4, k = 4) at each shards-a-host/window setting, beside DDP")
    p.add_argument("--ray-ps", action="store_true",
                   help="Ray's object-store parameter server (a Ray node in every host) beside DDP and shardps, n = 4")
    p.add_argument("--native-parts", action="store_true",
                   help="beside each shardps row with 4 server hosts and a window, the raw sockets PS in the same "
                        "parts with its per-part loop in C on both ends (baselines/raw_ps.py --parts --native; gcc)")
    p.add_argument("--raw-parts", action="store_true",
                   help="beside each shardps row with 4 server hosts and a window, the raw sockets PS cut into the "
                        "same parts, pushed the same window at a time (baselines/raw_ps.py --parts): the "
                        "per-part CPU floor of a parameter server in Python, in the same run")
    p.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    p.add_argument("--plot", metavar="PNG", help="step time against server hosts, with the formula's line")
    p.add_argument("--timeline", metavar="PNG", help="worker 0's link in one shardps step (n = 4, k = 4)")
    a = p.parse_args()
    missing = unavailable()
    if missing:
        print(f"benchmarks/cluster.py: {missing}", file=sys.stderr)
        return 2
    if a.native_parts:
        from baselines.native import NativeUnavailable, build

        try:
            build()  # once, before any row starts its processes
        except NativeUnavailable as e:
            print(f"benchmarks/cluster.py: {e}", file=sys.stderr)
            return 2
    links = a.links or (["200mbit"] if a.quick or a.grid else ["500mbit", "200mbit"])
    dims = _dims(a.dims)
    model_bytes = 4.0 * numel(dims)
    rows_ = [replace(c, whole=False) if a.library_parts else c
             for c in configs(a.quick, a.shards_per_host, a.window, a.sweep, a.ray_ps, a.bf16, a.grid, a.raw_parts,
                                 a.native_parts)]
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else print
    say(f"model {model_bytes / 1e6:.1f} MB ({a.dims}), batch {a.batch}, {a.steps} timed steps after {a.warmup}; "
        f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    table: list[dict[str, Any]] = []
    timeline = None
    with NetCluster(hosts=WORKER_HOSTS + SERVER_HOSTS, link=links[0]) as net:
        for link in links:
            for h in WORKER_HOSTS + SERVER_HOSTS:
                net.shape(h, link)
            got: dict[Config, list[dict[str, Any]]] = {c: [] for c in rows_}
            for r in range(a.rounds):
                for i in range(len(rows_)):
                    c = rows_[(i + r) % len(rows_)]
                    want_timeline = bool(a.timeline) and timeline is None and c.system == "shardps" \
                        and c.k == 4 and c.window is not None and c.sync == "bsp" and c.wire == "fp32"
                    t0 = time.monotonic()
                    m = measure(net, c, a, want_timeline)
                    if want_timeline:
                        timeline = (m["timeline"], link)
                    got[c].append(m)
                    say(f"  [{link} round {r + 1}/{a.rounds}] {c.label}: {m['step_s']:.3f} s a step "
                        f"({time.monotonic() - t0:.0f} s)")
            bits = parse_rate(link)
            for c in rows_:
                table.append(row(c, got[c], model_bytes, bits))
    for t in table:
        if a.json:
            print(json.dumps({k: v for k, v in t.items() if k != "label"}), flush=True)
    if not a.json:
        print_table(table)
    if a.plot:
        plot(a.plot, table)
    if a.timeline and timeline is not None:
        plot_timeline(a.timeline, *timeline)
    return 0


def print_table(table: list[dict[str, Any]]) -> None:
    for link in sorted({t["link_mbit"] for t in table}, reverse=True):
        rows_ = [t for t in table if t["link_mbit"] == link]
        ddp = {t["n"]: t["step_s"] for t in rows_ if t["system"] == "ddp"}
        print(f"\nlink {link} Mbit/s\n| system | n | step s | formula s | measured/formula | DDP/x | cpu s/step "
              "| fwd+bwd ms: median / slowest worker | drops/step | retransmitted | machine busy | softirq | kernel "
              "| steal |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for t in rows_:
            vs = ddp.get(t["n"])
            fb = (f"{t['compute_s'] * 1e3:.0f} / {t['slowest_compute_s'] * 1e3:.0f}" if "compute_s" in t else "-")
            print(f"| {t['label']} | {t['n']} | {t['step_s']:.3f} | {t['formula_s']:.3f} | {t['ratio']:.2f} | "
                  f"{vs / t['step_s']:.2f} | {t['cpu_s']:.2f} | {fb} | {t['drops_per_step']} | "
                  f"{t['retrans_share']:.2%} | "
                  f"{t['machine_busy']:.0%} | {t['machine_softirq']:.0%} | {t['machine_system']:.0%} | "
                  f"{t['machine_steal']:.0%} |"
                  if vs else "")


if __name__ == "__main__":
    sys.exit(main())
