#!/usr/bin/env python
"""What gradient compression costs in CPU and saves in bytes, and the link rate where the two break even.

A model of ``--mb`` MB of fp32 matrices (``--rows`` x ``--cols`` each) on
two shards; for dense fp32, top-k (``--ratio``, default 1 %) and PowerSGD
(``--rank``, default 4), each in turn, ``--repeats`` times (median):

CPU seconds of this process (``time.process_time``, one torch thread by
default), so that other work on a shared machine does not count:

* encode: the worker's work for one push: the compressor (error feedback,
  top-k or one power iteration, the chunks) and the framing of every
  message (dense: ``PushFramer``'s copy of the gradient into the messages);
* decode: the shard's work: every message parsed as the server's
  deserializer does (``framing.read_push_request``) and assembled by
  ``ChunkAssembler`` (checks, expansion into the fp32 staging);
* bytes: of those messages, as a shard receives them;
* push on loopback: ``client.push`` to two in-process shards over gRPC
  (``shm=False``), SGD with lr = 0, asp: wall time, the rest of the
  machine's load included.

``--link RATE`` (e.g. ``200mbit``; root: ``shardps.netsim``) times the push
on a simulated cluster instead of loopback: the two shards on two hosts of
their own, the worker on a third, every link shaped to RATE both ways (the
worker's uplink carries the whole gradient).

Break-even: compression pays on a link of bandwidth B when the time it saves
on the wire, (dense bytes - compressed bytes) / B, exceeds the CPU it adds,
(encode + decode) - (dense encode + decode): B = saved bytes / added seconds,
printed in Gbit/s. (Per worker and shard, one direction: pulls stay dense.)

    .venv/bin/python benchmarks/compress.py [--mb 64] [--repeats 5] [--json]
    .venv/bin/python benchmarks/compress.py --mb 16 --link 200mbit    # the push across shaped links
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from guard import run_guarded

import shardps
from shardps.compress import Compressor, PowerSGD, TopK
from shardps.protos import codec, framing
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.assembly import ChunkAssembler
from shardps.server.table import TensorSpec
from shardps.worker import layout
from shardps.worker.datapath.pushframes import PushFramer

MB = 1_000_000


def _median(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The median CPU time of this process (all threads) over ``repeats`` calls after one, and the last result:
    CPU seconds, not wall time, so that other work on a shared machine does not count."""
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), out


def _wall(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(args: argparse.Namespace, spec: Any, tensors: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
             layouts: Any, smap: Any, specs: dict[tuple[int, str], TensorSpec], model_bytes: int) -> dict[str, Any]:
    """One system's row: encode, decode, bytes, and a push over loopback."""
    comp = Compressor(spec, tensors, layouts, smap) if spec is not None else None

    def encode() -> list[list[bytes]]:
        flats = {k: g.reshape(-1) for k, g in grads.items()}
        packed = comp.encode(grads) if comp is not None else None
        out = []
        for shard in range(2):
            fr = PushFramer(worker_id=0, step=0, base_version=0, loss_scale=0.0, epoch=0,
                            packed=packed.of(shard) if packed is not None else ())
            dense = () if comp is not None else (
                m for p in smap.parts_for(shard)
                for m in fr.chunks(p.name, ps_pb2.FLOAT32, (args.rows, args.cols), flats[p.name], p.start,
                                   p.stop, codec.DEFAULT_CHUNK_BYTES))
            out.append(list(fr.ending(dense)))
        return out

    enc_s, messages = _median(encode, args.repeats)

    def decode() -> None:
        for shard in range(2):
            asm = ChunkAssembler(lambda name, s=shard: specs[(s, name)])
            for m in messages[shard]:
                asm.add(framing.read_push_request(m).chunk)
            asm.finish()

    dec_s, _ = _median(decode, args.repeats)
    wire = sum(len(m) for ms in messages for m in ms)
    row = {"encode_ms": enc_s * 1e3, "decode_ms": dec_s * 1e3, "wire_bytes": wire,
           "encode_ms_per_mb": enc_s * 1e3 * MB / model_bytes, "decode_ms_per_mb": dec_s * 1e3 * MB / model_bytes}
    if args.link is None:
        with shardps.LocalCluster(2) as cluster:
            row.update(_push(cluster.addresses, spec, tensors, grads, args.repeats))
    return row


def _push(addresses: list[str], spec: Any, tensors: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
          repeats: int) -> dict[str, float]:
    """Median wall time of ``client.push`` to the shards at ``addresses`` (registered afresh, asp, lr 0)."""
    with shardps.connect(addresses, shm=False) as client:
        client.register(tensors, shardps.optim.SGD(lr=0.0), sync="asp")
        step = iter(range(1 << 30))
        live = Compressor(spec, tensors, client.layouts, client.shard_map) if spec is not None else None
        start = sum(s["push_received_bytes_total"] for s in client.stats())
        push_s = _wall(lambda: client.push(grads, step=next(step), compressor=live), repeats)
        received = sum(s["push_received_bytes_total"] for s in client.stats()) - start
    return {"push_ms": push_s * 1e3, "received_bytes_per_push": received / (repeats + 1)}


def _model(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    n = max(1, round(args.mb * MB / (args.rows * args.cols * 4)))
    tensors = {f"layer{i}.weight": torch.zeros(args.rows, args.cols) for i in range(n)}
    gen = torch.Generator().manual_seed(0)
    return tensors, {k: torch.randn(t.shape, generator=gen) for k, t in tensors.items()}


def _systems(args: argparse.Namespace) -> dict[str, Any]:
    return {"dense": None, f"topk:{args.ratio}": TopK(args.ratio), f"powersgd:{args.rank}": PowerSGD(args.rank)}


def _on_links(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    """Each system's push from a worker host to two server hosts, every link at ``--link`` (``rows`` updated)."""
    from shardps.deploy.netsim import NetCluster

    with NetCluster(3, args.link) as net:
        addresses = [s.address for s in net.start_servers(net.names[:2])]
        argv = [sys.executable, os.path.abspath(__file__), "--push-only", ",".join(addresses), "--mb", str(args.mb),
                "--rows", str(args.rows), "--cols", str(args.cols), "--ratio", str(args.ratio), "--rank",
                str(args.rank), "--repeats", str(args.repeats), "--threads", str(args.threads)]
        done = net.run(net.names[2], argv, timeout=args.max_seconds / 2)
        for label, r in json.loads(done.stdout.splitlines()[-1]).items():
            rows[label].update(r)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tensors, grads = _model(args)
    n = len(tensors)
    layouts, smap = layout.plan(tensors, shardps.optim.SGD(lr=0.0), 2)
    specs = {}  # each shard's view of the tensors, as it registered them
    for shard in range(2):
        for name in tensors:
            parts = tuple((p.start, p.stop) for p in smap.parts_for(shard) if p.name == name)
            specs[(shard, name)] = TensorSpec(name, (args.rows, args.cols), ps_pb2.FLOAT32, shardps.optim.SGD(lr=0.0),
                                              parts)
    model_bytes = sum(t.numel() * 4 for t in tensors.values())
    rows: dict[str, dict[str, Any]] = {}
    for label, spec in _systems(args).items():
        rows[label] = _measure(args, spec, tensors, grads, layouts, smap, specs, model_bytes)
    if args.link is not None:
        _on_links(args, rows)
    dense = rows["dense"]
    for label, r in rows.items():
        added = (r["encode_ms"] + r["decode_ms"] - dense["encode_ms"] - dense["decode_ms"]) / 1e3
        saved = dense["wire_bytes"] - r["wire_bytes"]
        r["break_even_gbit_s"] = saved * 8 / added / 1e9 if label != "dense" and added > 0 else None
    return {"model_mb": model_bytes / MB, "tensors": n, "shape": [args.rows, args.cols], "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "load1": os.getloadavg()[0], "link": args.link or "loopback", "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64.0, help="model size in MB (10^6 bytes; default 64)")
    p.add_argument("--rows", type=int, default=1024, help="rows of each matrix (default 1024)")
    p.add_argument("--cols", type=int, default=1024, help="columns of each matrix (default 1024)")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k's ratio (default 0.01)")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of each; the median counts (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="time the push across a simulated cluster's links of RATE (e.g. 200mbit; needs root)")
    p.add_argument("--push-only", default=None, metavar="ADDRESSES", help=argparse.SUPPRESS)  # --link's worker
    p.add_argument("--max-seconds", type=float, default=600.0, help="watchdog for the whole run")
    args = p.parse_args()
    if args.push_only is not None:
        torch.set_num_threads(args.threads)
        tensors, grads = _model(args)
        rows = {label: _push(args.push_only.split(","), spec, tensors, grads, args.repeats)
                for label, spec in _systems(args).items()}
        print(json.dumps(rows))
        return 0
    res = run_guarded("compress.py", args.max_seconds, lambda: run(args), lambda: ())
    if res is None:
        return 1
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['model_mb']:.0f} MB of fp32 in {res['tensors']} x {res['shape']}, 2 shards, median of "
          f"{res['repeats']}, {res['torch_threads']} torch threads, load {res['load1']:.2f}; encode and decode in "
          f"CPU ms, push in wall ms ({res['link']})")
    print(f"{'system':<14} {'encode ms':>10} {'decode ms':>10} {'enc ms/MB':>10} {'dec ms/MB':>10} "
          f"{'wire MB':>9} {'push ms':>9} {'break-even Gbit/s':>18}")
    for label, r in res["rows"].items():
        be = f"{r['break_even_gbit_s']:.2f}" if r["break_even_gbit_s"] is not None else "-"
        print(f"{label:<14} {r['encode_ms']:>10.1f} {r['decode_ms']:>10.1f} {r['encode_ms_per_mb']:>10.3f} "
              f"{r['decode_ms_per_mb']:>10.3f} {r['wire_bytes'] / MB:>9.3f} {r['push_ms']:>9.1f} {be:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
