"""Register streams: idempotent, or refused (always refused when they could create a tensor)."""

from __future__ import annotations

import math

from shardps.protos.optim import SPECS
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.remedies import Remedy
from shardps.testing.fuzz.bugs import avoiding
from shardps.testing.fuzz.cases import (
    INT32,
    INT64,
    ITEMSIZE,
    SHORT_TIMEOUT,
    TIMEOUT,
    WIRE_DTYPES,
    Case,
    Source,
    Target,
    shifted,
    wild_int,
)
from shardps.testing.fuzz.draws import VALID_OPTIMIZERS, _text, bad_params_json, bad_sync_string, unknown_name, values
from shardps.testing.fuzz.gen_push import _cover

# -- Register --------------------------------------------------------------------

REGISTER_DEFECTS = ("bad_sync", "remedy", "num_workers", "worker_id", "bad_optimizer", "bad_params", "bad_dtype",
                    "bad_grad_dtype", "negative_dim", "part_range", "no_parts", "overlapping_parts", "empty_name",
                    "bad_holders", "duplicate_name", "undeclared_chunk", "chunk_dtype", "chunk_range",
                    "chunk_ragged", "chunk_empty", "chunk_shape", "partial_values", "changed_spec",
                    "loss_scaling", "chunks_without_values", "empty_stream")


def _random_spec(src: Source, name: str, avoid: bool) -> ps_pb2.TensorSpec:
    shape = [src.integer(1, 5) for _ in range(src.integer(0, 3))]
    if not avoiding(avoid, "huge-part-allocation") and src.integer(0, 7) == 0:  # a part far larger than memory
        shape = [src.choice([2**31, 2**40, 2**50, 2**62])]
    numel = math.prod(shape)
    opt, params = src.choice(VALID_OPTIMIZERS)
    if numel > 1 and src.boolean():
        cut = src.integer(1, numel - 1)
        parts = src.choice([[(0, cut)], [(cut, numel)], [(0, cut), (cut, numel)]])
    else:
        parts = [(0, numel)]
    dtype = src.choice(WIRE_DTYPES)
    return ps_pb2.TensorSpec(name=name, shape=shape, dtype=dtype, grad_dtype=src.choice([0, 0, *WIRE_DTYPES]),  # type: ignore[arg-type]
                             optimizer=ps_pb2.OptimizerSpec(name=opt, params_json=params),
                             parts=[ps_pb2.Part(start=a, stop=b) for a, b in parts])


def gen_register(src: Source, t: Target, avoid: bool) -> Case:
    """A Register stream: idempotent, or refused (always refused when it could create a tensor)."""
    sh = src.choice(t.shards)
    worker = src.choice(sh.registered) if sh.registered else 0
    first = ps_pb2.RegisterRequest(worker_id=worker, num_workers=sh.num_workers,
                                   sync=src.choice([sh.sync, "asp", "bsp", "every:2", "ssp:1", " BSP "]),
                                   provides_values=src.boolean(),
                                   staleness_remedy=src.choice(["", "", "none", " None "]))
    specs: list[ps_pb2.TensorSpec] = []
    for name in sorted(sh.tensors):
        if src.boolean():
            s = ps_pb2.TensorSpec()
            s.CopyFrom(sh.tensors[name].spec)
            specs.append(s)
    for _ in range(src.integer(0, 2)):
        specs.append(_random_spec(src, unknown_name(src, sh.tensors, True) or "new", avoid))
    creating = first.provides_values and any(s.name not in sh.tensors for s in specs)

    defects: list[str] = []
    later_chunks: list[ps_pb2.Chunk] = []
    damaged: set[int] = set()  # one spec defect per spec: no defect can undo another

    def undamaged_spec() -> ps_pb2.TensorSpec:
        free = [x for x in specs if id(x) not in damaged]
        if not free:
            specs.append(_random_spec(src, unknown_name(src, sh.tensors, True) or "new", avoid))
            free = specs[-1:]
        x = src.choice(free)
        damaged.add(id(x))
        return x

    need = 1 if creating else 0
    for _ in range(src.integer(need, 3)):
        d = src.choice(REGISTER_DEFECTS)
        if d in defects:
            continue
        spec_defects = ("bad_optimizer", "bad_params", "bad_dtype", "bad_grad_dtype", "negative_dim", "part_range",
                        "no_parts", "overlapping_parts", "empty_name", "bad_holders", "changed_spec")
        if d in spec_defects:
            if d == "changed_spec":
                if not sh.tensors:
                    continue
                s = ps_pb2.TensorSpec()
                s.CopyFrom(sh.tensors[src.choice(sorted(sh.tensors))].spec)
                s.shape.append(1)  # same size, another shape: valid, but not the registered spec
                specs = [x for x in specs if x.name != s.name]
                specs.insert(src.integer(0, len(specs)), s)
                damaged.add(id(s))
            else:
                s = undamaged_spec()
                if d == "bad_optimizer":
                    opt_name = src.choice(["", "SGD", "Adam", "lbfgs", "sgd ", "<text>"])
                    s.optimizer.name = src.text(16) if opt_name == "<text>" else opt_name
                    if s.optimizer.name in SPECS:
                        s.optimizer.name += "?"
                elif d == "bad_params":
                    s.optimizer.params_json = bad_params_json(src, s.optimizer.name, avoid)
                elif d == "bad_dtype":
                    dt = src.choice([0, 4, -1, wild_int(src, *INT32)])
                    s.dtype = dt if dt not in WIRE_DTYPES else 0  # type: ignore[assignment]
                elif d == "bad_grad_dtype":
                    dt = src.choice([4, 5, -1, wild_int(src, *INT32)])
                    s.grad_dtype = dt if dt not in (0, *WIRE_DTYPES) else 7  # type: ignore[assignment]
                elif d == "negative_dim":
                    s.shape.insert(src.integer(0, len(s.shape)), src.integer(INT64[0], -1))
                elif d == "part_range":
                    numel = min(math.prod(s.shape), INT64[1] - 1)
                    a, b = src.choice([(src.integer(INT64[0], -1), src.integer(0, 4)),
                                       (src.integer(0, max(0, numel)), src.integer(max(0, numel) + 1, INT64[1])),
                                       (3, 3), (5, 2)])
                    s.parts.append(ps_pb2.Part(start=a, stop=b))
                elif d == "no_parts":
                    del s.parts[:]
                    del s.holders[:]
                elif d == "overlapping_parts":
                    p = s.parts[0] if s.parts else ps_pb2.Part(start=0, stop=1)
                    s.parts.append(ps_pb2.Part(start=p.start, stop=p.stop))
                    if len(s.parts) < 2:
                        s.parts.append(ps_pb2.Part(start=p.start, stop=p.stop))
                elif d == "empty_name":
                    s.name = ""
                elif d == "bad_holders":
                    k = src.integer(0, 3)
                    del s.holders[:]
                    s.holders.extend(src.choice([[k, k], [len(s.peers) + k]]))
        elif d == "bad_sync":
            first.sync = bad_sync_string(src, avoid)
        elif d == "remedy":  # these jobs run without a staleness remedy: any other one is refused
            r = src.choice(["lr-scale", "dc-asgd", "dc-asgd:0.5", "dc-asgd:-1", "dc-asgd:nan", "dc-asgd:x", "fast",
                            "<text>"])
            r = _text(src, avoid) if r == "<text>" else r
            try:
                same = Remedy.parse(r) == Remedy()
            except ValueError:
                same = False
            first.staleness_remedy = r + "!" if same else r
        elif d == "num_workers":
            n = wild_int(src, *INT32)
            first.num_workers = n if n != sh.num_workers else shifted(n, 1, *INT32)
        elif d == "worker_id":
            w = wild_int(src, *INT32)
            first.worker_id = w if not 0 <= w < sh.num_workers else -1 - w
        elif d == "duplicate_name":
            if not specs:
                specs.append(_random_spec(src, unknown_name(src, sh.tensors, True) or "new", avoid))
            s = ps_pb2.TensorSpec()
            s.CopyFrom(src.choice(specs))
            specs.append(s)
        elif d == "loss_scaling":
            if sh.loss_scale != 0.0:
                continue  # this job has loss scaling: another setting would only be refused by luck
            first.loss_scaling.CopyFrom(ps_pb2.LossScaling(
                enabled=True, init_scale=src.choice([65536.0, src.double()]),
                growth_factor=src.choice([2.0, src.double()]), backoff_factor=src.choice([0.5, src.double()]),
                growth_interval=src.choice([2000, wild_int(src, *INT64)])))
        elif d == "chunks_without_values":
            first.provides_values = False
            later_chunks.append(ps_pb2.Chunk(name=src.choice([*(s.name for s in specs), "w"]), offset=0,
                                             dtype=ps_pb2.FLOAT32, data=b"\x00" * 4))
        elif d == "empty_stream":
            pass
        else:  # chunk defects: the initial values of a declared tensor are wrong
            first.provides_values = True
            declared = {s.name: s for s in specs}
            if d == "undeclared_chunk":
                later_chunks.append(ps_pb2.Chunk(name=unknown_name(src, declared, avoid), offset=0,
                                                 dtype=ps_pb2.FLOAT32, data=b"\x00" * 4))
            else:
                if not specs:
                    specs.append(_random_spec(src, unknown_name(src, sh.tensors, True) or "new", avoid))
                s = src.choice(specs)
                a, b = (s.parts[0].start, s.parts[0].stop) if s.parts else (0, 1)
                n = max(1, min(b - a, 4))
                c = ps_pb2.Chunk(name=s.name, offset=a, dtype=s.dtype, data=values(src, n, s.dtype))
                if d == "chunk_dtype":
                    c.dtype = src.choice([x for x in (0, *WIRE_DTYPES, 9) if x != s.dtype])  # type: ignore[assignment]
                elif d == "chunk_range":
                    far = min(max(b, math.prod(s.shape)), INT64[1] - n)
                    c.offset = src.choice([src.integer(INT64[0], -1), b - n + 1 if b - a >= n else b,
                                           src.integer(far, INT64[1] - n)])
                elif d == "chunk_ragged":
                    size = ITEMSIZE.get(s.dtype, 4)
                    c.data += b"\x01" * src.integer(1, max(1, size - 1))
                elif d == "chunk_empty":
                    c.data = b""
                elif d == "chunk_shape":
                    c.shape.extend([*s.shape, src.integer(2, 9)])
                elif d == "partial_values":
                    if b - a < 2 or s.dtype not in ITEMSIZE:
                        continue
                    c.data = values(src, src.integer(1, min(b - a - 1, 8)), s.dtype)
                later_chunks.append(c)
        defects.append(d)
    creating = first.provides_values and any(s.name not in sh.tensors for s in specs)
    if creating and not defects:  # every defect drawn was inapplicable
        first.worker_id = -1
        defects.append("worker_id")

    first.tensors.extend(specs)
    chunks: list[ps_pb2.Chunk] = []
    if first.provides_values:  # initial values for the declared tensors, valid unless a defect says otherwise
        for s in specs:
            if s.dtype not in ITEMSIZE or not src.boolean():
                continue
            for p in s.parts:
                if 0 <= p.start < p.stop and p.stop - p.start <= 4096:
                    chunks += _cover(src, s.name, s.dtype, p.start, p.stop)
                elif 0 <= p.start < p.stop:
                    chunks.append(ps_pb2.Chunk(name=s.name, offset=p.start, dtype=s.dtype,
                                               data=values(src, 1, s.dtype)))
    chunks += later_chunks
    messages = [first]
    if chunks and first.provides_values and src.boolean():
        first.chunk.CopyFrom(chunks.pop(0))
    for c in chunks:
        messages.append(ps_pb2.RegisterRequest(chunk=c, worker_id=src.choice([0, 0, 0, wild_int(src, *INT32)])))
    if "empty_stream" in defects:
        messages = []
    unknown = any(s.name not in sh.tensors for s in first.tensors)
    may_block = not first.provides_values and unknown
    return Case("register", "Register", sh.index, messages=messages, defects=tuple(defects),
                may_succeed=not defects, may_block=may_block, timeout=SHORT_TIMEOUT if may_block else TIMEOUT)
