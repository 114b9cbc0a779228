#!/usr/bin/env python
"""Transport benchmark: shardps push/pull versus a raw gRPC byte stream.

(Over 400 lines: the raw gRPC baseline (its server processes and client) and
the shardps and shared-memory paths live in one script, so that every ratio
comes from one run on one topology.)

Moves a ~100 MB fp32 transformer-like model (``--mb``) through two shards
and compares with the best that plain gRPC Python does with the same bytes
on the same topology, in the same run:

* shardps: ``LocalCluster(2, processes=True)`` (two ``shardps server``
  processes, the bytes as frames on the data connection, shm off unless
  asked; benchmarks/tcppath.py measures it against a raw socket pair),
  ``client.register(..., SGD(lr=0.0), sync="asp")``, then timed
  ``client.push(grads, step=i)`` and ``client.pull(out=...)``.
* raw: two server processes (this script with ``--serve-raw``) exposing a
  generic handler with identity (bytes) serializers: ``Push`` takes a client
  stream of ``--chunk-bytes`` messages and keeps them, ``Pull`` streams the
  kept messages back. The client splits the bytes over the two servers as
  the shardps shard map does, and talks to both in parallel threads, as
  PSClient does. It makes one copy per direction (tensor memory -> message
  bytes on push, message bytes -> output buffer on pull), the least any
  client that starts and ends with tensor memory must do.

After ``--warmup`` untimed rounds, ``--repeats`` rounds are timed, the two
systems alternating (first one, then the other, swapping each round) so
that background load on a shared machine hits both alike. Reported: median
MB/s (1 MB = 10^6 bytes) for push, pull and the push+pull round (2 x model
bytes / round time), and the ratio shardps/raw. Every RPC has a deadline,
the whole run a watchdog (``--max-seconds``), and every process started is
stopped on the way out, on error too.

    .venv/bin/python benchmarks/transport.py [--mb 100] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from guard import run_guarded

RAW_SERVICE = "shardps_bench.RawBytes"
RAW_READY = "raw grpc server listening on "
MB = 1_000_000
MiB = 1 << 20
# As server/service.py: room for a chunk of up to 3 MiB plus its header.
MAX_MESSAGE_BYTES = (3 << 20) + (64 << 10)
# Every child process started, for the watchdog's last resort.
_CHILDREN: list[subprocess.Popen[str]] = []


# -- the raw gRPC server (runs as `transport.py --serve-raw`) ----------------


def serve_raw(host: str) -> int:
    """A minimal bytes-in/bytes-out gRPC server: no protobuf, no torch."""
    lock = threading.Lock()
    kept: list[bytes] = []

    def push(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        msgs = list(request_iterator)
        with lock:
            kept[:] = msgs
        return sum(len(m) for m in msgs).to_bytes(8, "little")

    def pull(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        with lock:
            msgs = list(kept)
        yield from msgs

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(push),  # no (de)serializers: bytes as they are
        "Pull": grpc.unary_stream_rpc_method_handler(pull),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{host}:0")
    if port == 0:
        print(f"could not bind {host}:0", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: object) -> None:
        server.stop(grace=None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    print(f"{RAW_READY}{host}:{port}", flush=True)
    server.wait_for_termination()
    return 0


class RawServers:
    """``n`` raw server processes on loopback; ``stop()`` ends them all."""

    def __init__(self, n: int, host: str, startup_timeout: float) -> None:
        from shardps.deploy.local import read_ready  # here: the raw-server children import no torch

        self.procs: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--serve-raw", "--host", host],
                    stdout=subprocess.PIPE, text=True, start_new_session=True,
                    env=dict(os.environ, PYTHONUNBUFFERED="1")))
                _CHILDREN.append(self.procs[-1])
            for p in self.procs:
                self.addresses.append(read_ready(p, startup_timeout, RAW_READY).split()[0])
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 5.0) -> None:
        # Imported here: the raw-server children import no torch.
        from shardps.deploy.local import stop_processes

        stop_processes(self.procs, grace)
        self.procs = []


class RawClient:
    """Pushes/pulls one byte range per server, all servers in parallel threads."""

    def __init__(self, addresses: Sequence[str], chunk_bytes: int, timeout: float) -> None:
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._channels = [grpc.insecure_channel(a) for a in addresses]
        self._push = [c.stream_unary(f"/{RAW_SERVICE}/Push") for c in self._channels]
        self._pull = [c.unary_stream(f"/{RAW_SERVICE}/Pull") for c in self._channels]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="rawclient")
        for c in self._channels:
            grpc.channel_ready_future(c).result(timeout=timeout)

    def _each(self, fn: Any, args: Sequence[Any]) -> list[Any]:
        futs = [self._pool.submit(fn, i, a) for i, a in enumerate(args)]
        return [f.result(timeout=self.timeout + 5) for f in futs]

    def push(self, views: Sequence[memoryview]) -> None:
        """Send ``views[i]`` to server i as a client stream of chunk_bytes messages."""
        step = self.chunk_bytes

        def send(i: int, mv: memoryview) -> None:
            def messages() -> Iterator[bytes]:
                for a in range(0, len(mv), step):
                    yield bytes(mv[a:a + step])  # the one copy: memory -> message

            got = int.from_bytes(self._push[i](messages(), timeout=self.timeout), "little")
            if got != len(mv):
                raise RuntimeError(f"raw server {i} took {got} bytes, sent {len(mv)}")

        self._each(send, views)

    def pull(self, outs: Sequence[memoryview]) -> None:
        """Fill ``outs[i]`` from server i's stream (what it was last pushed)."""

        def fetch(i: int, mv: memoryview) -> None:
            pos = 0
            for m in self._pull[i](b"", timeout=self.timeout):
                mv[pos:pos + len(m)] = m  # the one copy: message -> memory
                pos += len(m)
            if pos != len(mv):
                raise RuntimeError(f"raw server {i} sent {pos} bytes, expected {len(mv)}")

        self._each(fetch, outs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self._channels:
            c.close()


# -- the model -----------------------------------------------------------------


def model_shapes(total_bytes: int, d: int = 768) -> dict[str, tuple[int, ...]]:
    """Transformer-like fp32 shapes summing to about ``total_bytes``.

    Blocks of width ``d`` (fused qkv, projection, 4x MLP, layer norms) fill
    about three quarters; a token embedding of ``d`` columns takes the rest.
    """
    block = {
        "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d), "attn.proj.bias": (d,),
        "ln1.weight": (d,), "ln1.bias": (d,),
        "mlp.fc1.weight": (4 * d, d), "mlp.fc1.bias": (4 * d,),
        "mlp.fc2.weight": (d, 4 * d), "mlp.fc2.bias": (d,),
        "ln2.weight": (d,), "ln2.bias": (d,),
    }
    block_numel = sum(math.prod(s) for s in block.values())
    total = max(d, total_bytes // 4)
    layers = int(total * 0.75) // block_numel
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        shapes.update({f"h{i}.{k}": s for k, s in block.items()})
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    rest = total - layers * block_numel - 2 * d
    shapes["wte.weight"] = (max(1, rest // d), d)
    return shapes


# -- measuring -----------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(push_s: list[float], pull_s: list[float], nbytes: int) -> dict[str, Any]:
    rounds = [a + b for a, b in zip(push_s, pull_s)]
    return {
        "push_s": push_s, "pull_s": pull_s, "round_s": rounds,
        "push_MBps": nbytes / MB / median(push_s),
        "pull_MBps": nbytes / MB / median(pull_s),
        "round_MBps": 2 * nbytes / MB / median(rounds),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import shardps

    if args.client_threads > 0:
        torch.set_num_threads(args.client_threads)
    nbytes_target = int(args.mb * MB)
    shapes = model_shapes(nbytes_target)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    outs = {n: torch.empty(s) for n, s in shapes.items()}
    nbytes = sum(t.numel() * 4 for t in weights.values())
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)
    log(f"model: {len(shapes)} fp32 tensors, {nbytes / MB:.1f} MB "
        f"(largest {max(shapes.items(), key=lambda kv: torch.Size(kv[1]).numel())})")

    cluster = raw = client = rclient = client_shm = opt_client = None
    try:
        t0 = time.perf_counter()
        cluster = shardps.LocalCluster(args.shards, processes=True, chunk_bytes=args.chunk_bytes,
                                       startup_timeout=args.startup_timeout, max_wait_s=args.rpc_timeout)
        try:
            cluster.start()
        finally:
            _CHILDREN.extend(getattr(cluster, "_procs", []))
        raw = RawServers(args.shards, "127.0.0.1", args.startup_timeout)
        log(f"servers up in {time.perf_counter() - t0:.1f}s: shardps {cluster.addresses}, raw {raw.addresses}")

        # Three shardps workers of one asp job (the same servers): the bytes in the data connection's frames,
        # through shared memory (the same-host fast path), and through DistributedOptimizer.step() (what
        # training loops call).
        def connect(worker_id: int, shm: bool) -> Any:
            return shardps.connect(cluster.addresses, timeout=args.rpc_timeout, chunk_bytes=args.chunk_bytes,
                                   ready_timeout=args.startup_timeout, worker_id=worker_id, num_workers=3, shm=shm)

        client = connect(0, False)
        client.register(weights, shardps.optim.SGD(lr=0.0), sync="asp")
        client_shm = connect(1, True)
        client_shm.register(weights, shardps.optim.SGD(lr=0.0), sync="asp")
        if not all(client_shm.shm_links):
            raise RuntimeError("the shared-memory path was not taken: is /dev/shm writable here?")
        opt_client = connect(2, args.optimizer_shm)
        params = {n: torch.nn.Parameter(torch.zeros_like(w)) for n, w in weights.items()}
        opt = shardps.DistributedOptimizer(list(params.items()), opt_client, optimizer=shardps.optim.SGD(lr=0.0),
                                           sync="asp")
        for n, p in params.items():
            p.grad = grads[n]
        assert client.shard_map is not None
        loads = client.shard_map.server_bytes()
        log(f"shard map: {len(client.shard_map.parts)} parts, bytes per shard {loads}")

        # The raw side carries the same bytes, split over the servers as shardps splits them.
        src = torch.cat([g.reshape(-1) for g in grads.values()]).view(torch.uint8)
        dst = torch.empty_like(src)
        bounds = [0]
        for b in loads:
            bounds.append(bounds[-1] + b)
        src_mv = memoryview(src.numpy()).cast("B")
        dst_mv = memoryview(dst.numpy()).cast("B")
        src_views = [src_mv[a:b] for a, b in zip(bounds, bounds[1:])]
        dst_views = [dst_mv[a:b] for a, b in zip(bounds, bounds[1:])]
        rclient = RawClient(raw.addresses, args.chunk_bytes, args.rpc_timeout)

        systems = ("shardps", "shardps-shm", "optimizer", "raw", "memcpy")
        times: dict[str, dict[str, list[float]]] = {k: {"push": [], "pull": []} for k in systems}
        steps = {"shardps": 0, "shardps-shm": 0}
        outs_shm = {n: torch.empty(s) for n, s in shapes.items()}
        buf = torch.empty_like(src)

        def round_client(name: str, c: Any, out: dict[str, torch.Tensor], record: bool) -> None:
            t = time.perf_counter()
            c.push(grads, step=steps[name])
            t1 = time.perf_counter()
            c.pull(out=out)
            t2 = time.perf_counter()
            steps[name] += 1
            if record:
                times[name]["push"].append(t1 - t)
                times[name]["pull"].append(t2 - t1)

        def round_shardps(record: bool) -> None:
            round_client("shardps", client, outs, record)

        def round_shm(record: bool) -> None:
            round_client("shardps-shm", client_shm, outs_shm, record)

        def round_optimizer(record: bool) -> None:  # push + pull in one call: the round only
            t = time.perf_counter()
            opt.step()
            if record:
                times["optimizer"]["push"].append(float("nan"))
                times["optimizer"]["pull"].append(time.perf_counter() - t)

        def round_memcpy(record: bool) -> None:  # the physical limit of one machine: one copy each way
            t = time.perf_counter()
            buf.copy_(src)
            t1 = time.perf_counter()
            dst.copy_(buf)
            t2 = time.perf_counter()
            if record:
                times["memcpy"]["push"].append(t1 - t)
                times["memcpy"]["pull"].append(t2 - t1)

        def round_raw(record: bool) -> None:
            t = time.perf_counter()
            rclient.push(src_views)
            t1 = time.perf_counter()
            rclient.pull(dst_views)
            t2 = time.perf_counter()
            if record:
                times["raw"]["push"].append(t1 - t)
                times["raw"]["pull"].append(t2 - t1)

        rounds = [round_shardps, round_shm, round_optimizer, round_raw, round_memcpy]
        for r in range(args.warmup + args.repeats):
            record = r >= args.warmup
            k = r % len(rounds)  # each round starts with another system, so background load hits all alike
            for fn in rounds[k:] + rounds[:k]:
                fn(record)
            if record:
                i = r - args.warmup
                log(f"round {i + 1}/{args.repeats}: " + " | ".join(
                    f"{k} {sum(v[-1] for v in times[k].values() if v[-1] == v[-1]):.3f}s" for k in systems))
            else:
                log(f"warm-up {r + 1}/{args.warmup} done")

        # The bytes made it: lr=0 keeps the weights, the raw servers echo what they got.
        ok_shardps = all(torch.equal(outs[n], weights[n]) and torch.equal(outs_shm[n], weights[n]) for n in shapes)
        ok_opt = all(torch.equal(p.detach(), weights[n]) for n, p in params.items())
        ok_raw = torch.equal(src, dst)
        if not (ok_shardps and ok_raw and ok_opt):
            raise RuntimeError(f"data check failed: shardps {ok_shardps}, optimizer {ok_opt}, raw {ok_raw}")
        stats = client.stats()
    finally:
        for c in (rclient, client, client_shm, opt_client):
            if c is not None:
                try:
                    c.close()
                except Exception as e:  # noqa: BLE001 - still stop the servers
                    print(f"closing client: {e}", file=sys.stderr)
        if raw is not None:
            raw.stop()
        if cluster is not None:
            cluster.stop()

    res = {k: summarize(times[k]["push"], times[k]["pull"], nbytes) for k in systems if k != "optimizer"}
    res_s, res_r = res["shardps"], res["raw"]
    res["optimizer"] = {"round_MBps": 2 * nbytes / MB / median(times["optimizer"]["pull"])}
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "grpcio": grpc.__version__, "torch": torch.__version__,
                    "client_torch_threads": torch.get_num_threads()},
        "model": {"tensors": len(shapes), "bytes": nbytes, "MB": nbytes / MB},
        "shards": args.shards, "chunk_bytes": args.chunk_bytes, "optimizer_shm": args.optimizer_shm,
        "warmup": args.warmup, "repeats": args.repeats, "bytes_per_shard": loads,
        "shardps": res_s, "raw": res_r, "shardps_shm": res["shardps-shm"], "memcpy": res["memcpy"],
        "optimizer": res["optimizer"],
        "ratio": {k: res_s[f"{k}_MBps"] / res_r[f"{k}_MBps"] for k in ("push", "pull", "round")},
        "ratio_shm": {k: res["shardps-shm"][f"{k}_MBps"] / res_r[f"{k}_MBps"] for k in ("push", "pull", "round")},
        "ratio_shm_memcpy": {k: res["shardps-shm"][f"{k}_MBps"] / res["memcpy"][f"{k}_MBps"]
                             for k in ("push", "pull", "round")},
        "ratio_optimizer": res["optimizer"]["round_MBps"] / (res_s["round_MBps"] if not args.optimizer_shm
                                                             else res["shardps-shm"]["round_MBps"]),
        "ratio_optimizer_raw": res["optimizer"]["round_MBps"] / res_r["round_MBps"],
        "server_push_bytes_total": [s["push_bytes_total"] for s in stats],
        "server_pull_bytes_total": [s["pull_bytes_total"] for s in stats],
    }


def report(res: dict[str, Any]) -> str:
    s, r, q = res["shardps"], res["raw"], res["ratio"]
    m, h, qs, qm = res["shardps_shm"], res["memcpy"], res["ratio_shm"], res["ratio_shm_memcpy"]
    lines = [
        f"transport: {res['model']['MB']:.1f} MB fp32 ({res['model']['tensors']} tensors), "
        f"{res['shards']} shard processes, {res['chunk_bytes']} B chunks, "
        f"median of {res['repeats']} (after {res['warmup']} warm-up), {res['machine']['cpus']} CPUs",
        f"{'':10}{'push MB/s':>12}{'pull MB/s':>12}{'round MB/s':>12}",
        f"{'shardps':10}{s['push_MBps']:12.1f}{s['pull_MBps']:12.1f}{s['round_MBps']:12.1f}",
        f"{'raw gRPC':10}{r['push_MBps']:12.1f}{r['pull_MBps']:12.1f}{r['round_MBps']:12.1f}",
        f"{'ratio':10}{q['push']:12.2f}{q['pull']:12.2f}{q['round']:12.2f}",
        f"{'shm':10}{m['push_MBps']:12.1f}{m['pull_MBps']:12.1f}{m['round_MBps']:12.1f}"
        "   (the same-host fast path)",
        f"{'memcpy':10}{h['push_MBps']:12.1f}{h['pull_MBps']:12.1f}{h['round_MBps']:12.1f}"
        "   (one copy each way: this machine's limit)",
        f"{'shm/raw':10}{qs['push']:12.2f}{qs['pull']:12.2f}{qs['round']:12.2f}",
        f"{'shm/memcpy':10}{qm['push']:12.2f}{qm['pull']:12.2f}{qm['round']:12.2f}",
        f"DistributedOptimizer.step() ({'shm' if res['optimizer_shm'] else 'frames'}): round "
        f"{res['optimizer']['round_MBps']:.1f} MB/s, {res['ratio_optimizer']:.2f} of PSClient push+pull on the "
        f"same path, {res['ratio_optimizer_raw']:.2f} of raw gRPC",
        "(round: push then pull, 2 x model bytes over the round's time; ratio: shardps / raw)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="model size in MB (10^6 bytes; default 100)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per system (default 5; the median counts)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--chunk-bytes", type=int, default=MiB, help="bytes per streamed message (default 1 MiB)")
    p.add_argument("--shards", type=int, default=2, help="server processes per system (default 2)")
    p.add_argument("--client-threads", type=int, default=0,
                   help="torch intra-op threads in this (client) process (default 0: torch's default)")
    p.add_argument("--optimizer-shm", action="store_true",
                   help="DistributedOptimizer.step() through shared memory (default: frames, as PSClient's row)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--rpc-timeout", type=float, default=60.0, help="deadline of every RPC, seconds (default 60)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for servers to come up (default 60)")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="watchdog: abort the whole run after this many seconds (default 600)")
    p.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_raw:
        return serve_raw(args.host)
    if args.repeats < 1 or args.warmup < 0 or args.mb <= 0 or args.shards < 1:
        p.error("need --repeats >= 1, --warmup >= 0, --mb > 0, --shards >= 1")
    if not 1024 <= args.chunk_bytes <= 3 * MiB:
        p.error(f"--chunk-bytes must be in [1024, {3 * MiB}] (shardps's limits)")

    res = run_guarded("transport.py", args.max_seconds, lambda: run(args), lambda: _CHILDREN)
    if res is None:
        return 130
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
