"""Server-side optimizer step time vs torch's fastest optimizer, same parameters, same run.

    .venv/bin/python benchmarks/optimizer_speed.py [--params 25e6] [--repeats 5] [--push-dtype float32]

Registers a GPT-like set of fp32 tensors (about --params elements) on one
ShardStore (no network: this measures the server's step), then times
    shardps apply   the optimizer step inside ShardStore.submit (all parts)
    shardps submit  the whole submit: policy + step + bookkeeping, given fp32
                    gradients already assembled and checked
    whole path      a Push as the server handles it: the worker's serialized
                    PushRequests (1 MiB chunks, --push-dtype) -> the gRPC
                    deserializer (framing.parse_push_request) -> decode_push
                    (ChunkAssembler: staging, casts, the inf/nan check) ->
                    ShardStore.submit -> the applied step. Each message is
                    framed just before the server reads it, as if gRPC had
                    just received it (its bytes in cache); framing it is the
                    worker's and the transport's cost (benchmarks/transport.py)
                    and is not counted. "cold": all messages framed first,
                    then read (mostly out of cache by then).
against torch.optim.Adam(fused=True) (and foreach, and the plain loop) on
tensors of the same shapes, all interleaved in one process. Prints
milliseconds per step (median of --repeats) and the ratio torch_fused_ms /
shardps_ms (>= 1: shardps is faster), each from this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator

import torch

from shardps import optim
from shardps.protos import codec, framing
from shardps.protos.shardmap import TensorInfo, build_shard_map
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.wire import decode_push
from shardps.server.store import ShardStore, TensorSpec

PUSH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shapes_for(params: float) -> list[tuple[int, ...]]:
    """Transformer-block shapes (d, 3d), (d, d), (d, 4d), (4d, d) + vectors, scaled to ~params."""
    d = 768
    block = [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,), (d,), (d,)]
    per = sum(torch.Size(s).numel() for s in block)
    n_blocks = max(1, round(params / per))
    return block * n_blocks


def make_torch(shapes, grads, mode: str) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g
    kw = {"fused": True} if mode == "fused" else {"foreach": mode == "foreach"}
    return torch.optim.Adam(params, lr=1e-3, **kw)


class ShardpsStep:
    """One ShardStore holding the same tensors; ``__call__`` is one submit (timed inside)."""

    def __init__(self, shapes, grads, push_dtype: torch.dtype = torch.float32) -> None:
        self.store = ShardStore(0, 1, sync="asp", num_workers=1)
        self.smap = smap = build_shard_map([TensorInfo(f"t{i}", s) for i, s in enumerate(shapes)], 1)
        self.push_wire = codec.to_wire_dtype(push_dtype)
        self.wire_grads = [g.to(push_dtype).view(-1) for g in grads]  # as the worker sends them
        self.shapes = shapes
        specs, values = [], {}
        for i, s in enumerate(shapes):
            name = f"t{i}"
            parts = tuple((p.start, p.stop) for p in smap.parts_of(name))
            specs.append(TensorSpec(name, s, codec.to_wire_dtype(torch.float32), optim.Adam(lr=1e-3), parts,
                                    grad_dtype=self.push_wire))
            flat = torch.randn(s).view(-1)
            for a, b in parts:
                values[(name, a)] = flat[a:b]
        self.store.path.register_tensors(specs, values)
        self.store.leases.register(0)
        self.grads = {}
        for i, g in enumerate(grads):
            for p in smap.parts_of(f"t{i}"):
                self.grads[(p.name, p.start)] = g.view(-1)[p.start : p.stop]
        self.step = 0
        self.apply_ms: list[float] = []
        self.submit_ms: list[float] = []
        self.whole_ms: list[float] = []  # wire messages in cache, as the server sees them
        self.decode_ms: list[float] = []  # ... of which parsing and assembling
        self.cold_ms: list[float] = []  # wire messages framed first, read later

    def __call__(self) -> None:
        g = {k: v.clone() for k, v in self.grads.items()}  # the store owns what it is given; not timed
        a0 = self.store.applier.apply_seconds_total
        t0 = time.perf_counter()
        self.store.path.submit(0, self.step, self.store.job.version, g, checked=True)
        self.submit_ms.append((time.perf_counter() - t0) * 1000)
        self.apply_ms.append((self.store.applier.apply_seconds_total - a0) * 1000)
        self.step += 1

    def messages(self) -> Iterator[bytes]:
        """This step's serialized PushRequests, framed as the worker frames them (worker/client.py)."""
        prefix, suffix = framing.header(ps_pb2.PushRequest, worker_id=0, step=self.step,
                                        base_version=self.store.job.version, epoch=self.store.job.epoch)
        for i, flat in enumerate(self.wire_grads):
            for p in self.smap.parts_of(f"t{i}"):
                for _, _, msg in framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, p.name,
                                                        self.push_wire, self.shapes[i], flat, p.start, p.stop,
                                                        codec.DEFAULT_CHUNK_BYTES):
                    yield msg

    def push(self, cold: bool = False) -> None:
        """One Push through the server's whole path, timed without the framing of its messages."""
        source = iter(list(self.messages())) if cold else self.messages()
        framing_s = 0.0

        def received() -> Iterator[object]:  # what the servicer's request_iterator yields
            nonlocal framing_s
            while True:
                t = time.perf_counter()
                msg = next(source, None)
                framing_s += time.perf_counter() - t
                if msg is None:
                    return
                yield framing.parse_push_request(msg)  # gRPC's deserializer for Push: counted

        store = self.store
        t0 = time.perf_counter()
        # as WorkersServicer.Push
        g = decode_push(received(), store.table.spec, store.applier.pool.take, keep_chunks=store.path.takes_chunked)
        t1 = time.perf_counter()
        res = store.path.submit(g.worker_id, g.step, g.base_version, g.grads, g.nbytes, found_inf=g.found_inf,
                           loss_scale=g.loss_scale, epoch=g.epoch, checked=True)
        t2 = time.perf_counter()
        if not res.applied:
            raise RuntimeError(f"step {self.step} was not applied: {res}")
        if cold:
            self.cold_ms.append((t2 - t0 - framing_s) * 1000)
        else:
            self.whole_ms.append((t2 - t0 - framing_s) * 1000)
            self.decode_ms.append((t1 - t0 - framing_s) * 1000)
        self.step += 1


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--push-dtype", choices=sorted(PUSH_DTYPES), default="float32",
                    help="dtype of the pushed gradients on the wire (whole path)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = shapes_for(args.params)
    n = sum(torch.Size(s).numel() for s in shapes)
    grads = [torch.randn(s) for s in shapes]
    print(f"Adam step on {n / 1e6:.1f}M fp32 parameters in {len(shapes)} tensors, "
          f"{args.threads} threads, median of {args.repeats}", flush=True)
    res: dict[str, float | str] = {"params": n, "push_dtype": args.push_dtype}
    opts = {mode: make_torch(shapes, grads, mode) for mode in ("fused", "foreach", "loop")}
    ours = ShardpsStep(shapes, grads, PUSH_DTYPES[args.push_dtype])
    times: dict[str, list[float]] = {mode: [] for mode in opts}
    for _ in range(args.repeats + 1):  # interleaved, so drift in machine load hits all alike
        for mode, opt in opts.items():
            times[mode].append(timed(opt.step))
        ours()
        ours.push()
        ours.push(cold=True)
    for mode in opts:
        res[f"torch_{mode}_ms"] = statistics.median(times[mode][1:])
    res["shardps_apply_ms"] = statistics.median(ours.apply_ms[1:])
    res["shardps_submit_ms"] = statistics.median(ours.submit_ms[1:])
    res["whole_path_ms"] = statistics.median(ours.whole_ms[1:])
    res["whole_path_decode_ms"] = statistics.median(ours.decode_ms[1:])
    res["whole_path_cold_ms"] = statistics.median(ours.cold_ms[1:])
    chunks = [g.view(-1)[i : i + (1 << 18)] for g in grads for i in range(0, g.numel(), 1 << 18)]
    res["check_ms"] = statistics.median(
        timed(lambda: all(codec.all_finite(c) for c in chunks)) for _ in range(args.repeats))
    print(f"  torch.optim.Adam(fused=True)   {res['torch_fused_ms']:8.1f} ms")
    print(f"  torch.optim.Adam(foreach=True) {res['torch_foreach_ms']:8.1f} ms")
    print(f"  torch.optim.Adam (for-loop)    {res['torch_loop_ms']:8.1f} ms")
    print(f"  shardps server: optimizer step {res['shardps_apply_ms']:8.1f} ms")
    print(f"  shardps server: whole submit   {res['shardps_submit_ms']:8.1f} ms (+ sync policy and bookkeeping)")
    print(f"  inf/nan check of the pushed chunks {res['check_ms']:6.1f} ms (done as chunks arrive, before submit)")
    print(f"  shardps server: whole path     {res['whole_path_ms']:8.1f} ms ({args.push_dtype} Push messages as "
          f"received -> parse, assemble, check ({res['whole_path_decode_ms']:.1f} ms) -> submit -> step)")
    print(f"  shardps server: whole path, messages out of cache {res['whole_path_cold_ms']:8.1f} ms")
    fused = res["torch_fused_ms"]
    res["ratio_apply"] = fused / res["shardps_apply_ms"]
    res["ratio_submit"] = fused / res["shardps_submit_ms"]
    res["ratio_whole_path"] = fused / res["whole_path_ms"]
    res["ratio_whole_path_cold"] = fused / res["whole_path_cold_ms"]
    print(f"speed vs fused torch Adam: optimizer step {res['ratio_apply']:.2f}, "
          f"whole submit {res['ratio_submit']:.2f}, whole path {res['ratio_whole_path']:.2f} "
          f"(messages out of cache {res['ratio_whole_path_cold']:.2f}) (target >= 0.9)")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
