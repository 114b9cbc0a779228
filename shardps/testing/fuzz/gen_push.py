"""Push streams built to be refused: each with at least one defect, framed as the worker frames them or not."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardps.protos import compressed
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.fuzz.bugs import avoiding
from shardps.testing.fuzz.cases import INT32, INT64, ITEMSIZE, WIRE_DTYPES, Case, Source, Target, shifted, wild_int
from shardps.testing.fuzz.draws import bad_sync_string, unknown_name, values

# -- Push ----------------------------------------------------------------------

PUSH_DEFECTS = ("unregistered_worker", "negative_step", "future_step", "base_version", "loss_scale",
                "unknown_name", "wrong_dtype", "wrong_shape", "ragged_data", "empty_data", "offset", "partial",
                "overlap", "mixed_headers", "empty_stream", "wrong_epoch", "bad_slice", "bad_sync",
                # compressed chunks (protos/compressed.py): a chunk made one, then broken
                "topk_duplicate", "topk_index_range", "topk_indices_size", "lowrank_factor_size", "lowrank_rows",
                "bad_encoding", "dense_with_indices")
COMPRESSED_DEFECTS = PUSH_DEFECTS[-7:]


def _indices(idx: Sequence[int], numel: int) -> bytes:
    fmt = "i" if compressed.index_dtype(numel) == torch.int32 else "q"
    return struct.pack(f"<{len(idx)}{fmt}", *idx)


def _pack(src: Source, c: ps_pb2.Chunk, info: Any, n: int, lowrank: bool) -> bool:
    """Make ``c`` a well-formed compressed chunk of the same ``n`` elements from its offset (TOPK: 1 to 8
    values; LOWRANK: whole rows of a matrix, rank 1 to 3); False when LOWRANK cannot cover that range."""
    cols = compressed.columns(info.shape)
    packed = ps_pb2.Chunk(name=c.name, offset=c.offset, dtype=c.dtype, shape=c.shape, numel=n)
    if lowrank:
        if not cols or c.offset % cols or n % cols:
            return False
        rank = src.integer(1, 3)
        packed.encoding, packed.rank = compressed.LOWRANK, rank
        packed.data, packed.factor = values(src, n // cols * rank, c.dtype), values(src, cols * rank, c.dtype)
    else:
        idx = sorted({src.integer(0, n - 1) for _ in range(src.integer(1, min(n, 8)))})
        packed.encoding, packed.indices = compressed.TOPK, _indices(idx, n)
        packed.data = values(src, len(idx), c.dtype)
    c.CopyFrom(packed)
    return True


def _inside_a_part(parts: Sequence[tuple[int, int]], offset: int, n: int) -> bool:
    return any(a <= offset and offset + n <= b for a, b in parts)


def _cover(src: Source, name: str, dtype: int, a: int, b: int, max_pieces: int = 3) -> list[ps_pb2.Chunk]:
    """Chunks that cover [a, b) exactly once."""
    n = b - a
    k = src.integer(1, max(1, min(max_pieces, n)))
    cuts = sorted({src.integer(a + 1, b - 1) for _ in range(k - 1)}) if n > 1 else []
    bounds = [a, *cuts, b]
    return [ps_pb2.Chunk(name=name, offset=x, dtype=dtype, data=values(src, y - x, dtype))  # type: ignore[arg-type]
            for x, y in zip(bounds, bounds[1:])]


def gen_push(src: Source, t: Target, avoid: bool) -> Case:
    """A Push stream with at least one defect: it must be refused.

    Each chunk is damaged by at most one defect and a damaged chunk never
    moves back inside the range it came from, so no defect undoes another.
    """
    sh = src.choice(t.shards)
    worker = src.choice(sh.registered) if sh.registered else 0
    last = sh.clocks.get(worker, -1)
    header: dict[str, Any] = dict(worker_id=worker, step=last + 1, base_version=src.integer(0, max(0, sh.version)),
                                  found_inf=src.boolean(), loss_scale=src.choice([0.0, 0.0, 1.0, 1024.0, 0.5]),
                                  epoch=sh.epoch)
    chunks: list[ps_pb2.Chunk] = []
    for name in sorted(sh.tensors):
        if src.boolean():
            info = sh.tensors[name]
            tensor_chunks = []
            for a, b in info.parts:
                piece = _cover(src, name, info.push_dtype, a, b)
                if src.integer(0, 3) == 0:  # a well-formed compressed chunk instead of the dense ones
                    piece = piece[:1]
                    if not _pack(src, piece[0], info, b - a, src.boolean()):
                        _pack(src, piece[0], info, b - a, False)
                tensor_chunks += piece
            if src.boolean():
                tensor_chunks[0].shape.extend(info.shape)
            chunks += tensor_chunks
    damaged: set[int] = set()

    def pick(ok: Callable[[ps_pb2.Chunk], bool] = lambda c: True) -> ps_pb2.Chunk | None:
        """An undamaged chunk (new ones covering a part again if none is left: overlapping, also refused)."""
        for _ in range(2):
            free = [c for c in chunks if id(c) not in damaged and ok(c)]
            if free:
                c = src.choice(free)
                damaged.add(id(c))
                return c
            info = sh.tensors[src.choice(sorted(sh.tensors))]
            a, b = src.choice(info.parts)
            chunks.extend(_cover(src, info.name, info.push_dtype, a, b))
        return None

    def span(c: ps_pb2.Chunk) -> int:
        return compressed.span(c) if c.encoding in compressed.NAMES else len(c.data) // ITEMSIZE.get(c.dtype, 4)

    def splittable(c: ps_pb2.Chunk) -> bool:
        info = sh.tensors.get(c.name)
        return info is not None and c.dtype == info.push_dtype and len(c.data) >= 2 * ITEMSIZE[c.dtype]

    defects: list[str] = []
    for _ in range(src.integer(1, 3)):
        d = src.choice(PUSH_DEFECTS)
        if d in defects:
            continue
        if d == "unregistered_worker":
            w = wild_int(src, *INT32)
            while w in sh.registered:
                w = w + 1 if w < INT32[1] else INT32[0]
            header["worker_id"] = w
        elif d == "negative_step":
            header["step"] = src.integer(INT64[0], -1)
        elif d == "future_step":
            header["step"] = src.integer(last + 2, INT64[1])
        elif d == "base_version":
            header["base_version"] = src.choice([src.integer(INT64[0], -1), src.integer(sh.version + 1, INT64[1])])
        elif d == "wrong_epoch":
            e = wild_int(src, *INT64)
            header["epoch"] = e if e != sh.epoch else shifted(e, 1, *INT64)
        elif d == "bad_sync":  # the mode the step ran under, and its sync switch: one of them cannot be
            kind = src.integer(0, 2)
            if kind == 0:
                header["sync_switch"], header["sync"] = src.integer(INT64[0], -1), src.choice(["", "bsp", "asp"])
            elif kind == 1:  # a switch with no mode
                header["sync_switch"], header["sync"] = src.integer(1, INT64[1]), ""
            else:
                header["sync_switch"], header["sync"] = src.integer(0, INT64[1]), bad_sync_string(src, avoid) or "BSP!"
        elif d == "loss_scale":
            v = src.double()
            if v == 0.0 or (math.isfinite(v) and v > 0):
                v = src.choice([math.nan, math.inf, -math.inf, -1.0, -5e-324, -1e308])
            header["loss_scale"] = v
        elif d == "unknown_name":
            c = pick()
            assert c is not None
            c.name = unknown_name(src, sh.tensors, avoid)
        elif d == "wrong_dtype":
            c = pick()
            assert c is not None
            push_dtype = sh.tensors[c.name].push_dtype
            dt = src.choice([*WIRE_DTYPES, 0, wild_int(src, *INT32)])
            c.dtype = dt if dt != push_dtype else (dt % 3) + 1  # type: ignore[assignment]
        elif d == "wrong_shape":
            c = pick()
            assert c is not None
            long = not avoiding(avoid, "oversized-error-details") and src.integer(0, 9) == 0
            ndim = src.integer(3000, 20000) if long else src.integer(1, 6)
            shape = [wild_int(src, *INT64) if ndim < 10 else 1 for _ in range(ndim)]
            if tuple(shape) == sh.tensors[c.name].shape:
                shape.append(1)
            del c.shape[:]
            c.shape.extend(shape)
        elif d == "bad_slice":  # a slice (PushRequest.slices) that does not fit a tensor the Push carries
            c = pick()
            assert c is not None
            held = sh.tensors.get(c.name)
            ndim = len(held.shape) if held is not None else 2
            parts = src.integer(1, 4)
            sl = ps_pb2.TensorSlice(name=c.name, dim=0, parts=parts, index=src.integer(0, parts - 1), blocks=1)
            kind = src.integer(0, 3) if ndim else 0
            if kind == 0:
                sl.dim = src.choice([src.integer(INT32[0], -1), ndim + src.integer(0, 3)])
            elif kind == 1:
                sl.index = src.choice([parts + src.integer(0, 5), src.integer(INT32[0], -1)])
            elif kind == 2:
                sl.parts, sl.index = src.integer(INT32[0], 0), 0
            else:
                sl.blocks = src.integer(INT32[0], -1)
            header["slices"] = [sl]
        elif d == "ragged_data":
            c = pick()
            assert c is not None
            c.data = c.data + src.binary(1, ITEMSIZE[c.dtype] - 1)
        elif d == "empty_data":
            c = pick()
            assert c is not None
            c.data = b""
        elif d == "offset":
            c = pick()
            assert c is not None
            n = len(c.data) // ITEMSIZE[c.dtype]
            info = sh.tensors[c.name]
            a, b = src.choice(info.parts)
            options = [src.integer(INT64[0], -1), src.integer(info.numel, INT64[1] - n),
                       b - n + src.integer(1, n)]  # the last one straddles the end of a part
            elsewhere = t.parts_elsewhere(sh.index, c.name)
            if elsewhere:
                options.append(src.choice(elsewhere)[0])  # a part another shard owns
            off = src.choice(options)
            if _inside_a_part(info.parts, off, n):
                off = -1 - src.integer(0, 10)
            c.offset = off
        elif d == "partial":
            c = pick(splittable)
            if c is None:
                continue
            size = ITEMSIZE[c.dtype]
            keep = src.integer(1, len(c.data) // size - 1)
            if src.boolean():
                c.data = c.data[: keep * size]  # the end of the range goes missing
            else:
                drop = len(c.data) // size - keep
                c.data = c.data[drop * size :]  # the start goes missing
                c.offset += drop
        elif d in COMPRESSED_DEFECTS:
            c = pick(lambda c: c.name in sh.tensors and c.dtype == sh.tensors[c.name].push_dtype and span(c) > 0)
            if c is None:
                continue
            n = span(c)
            if d == "dense_with_indices":
                c.CopyFrom(ps_pb2.Chunk(name=c.name, offset=c.offset, dtype=c.dtype, shape=c.shape,
                                        data=values(src, n, c.dtype)))
                if src.boolean():
                    c.indices = _indices([0], n)
                else:
                    c.numel = n
            elif not _pack(src, c, sh.tensors[c.name], n, d.startswith("lowrank")):
                continue  # no whole rows here: another draw
            elif d == "topk_duplicate":
                i = src.integer(0, n - 1)
                c.indices, c.data = _indices([i, i], n), values(src, 2, c.dtype)
            elif d == "topk_index_range":
                c.indices = _indices([src.choice([n + src.integer(0, 3), -1 - src.integer(0, 3)])], n)
                c.data = values(src, 1, c.dtype)
            elif d == "topk_indices_size":
                c.indices = c.indices + src.binary(1, 3) if src.boolean() else c.indices[: src.integer(0, 3)]
            elif d == "lowrank_factor_size":
                c.factor = c.factor + values(src, src.integer(1, 3), c.dtype) if src.boolean() else c.factor[:-1]
            elif d == "lowrank_rows":
                c.numel = n + src.integer(1, compressed.columns(sh.tensors[c.name].shape) - 1) \
                    if compressed.columns(sh.tensors[c.name].shape) > 1 else n + 1
            elif d == "bad_encoding":
                e = wild_int(src, *INT32)
                c.encoding = e if e not in compressed.NAMES else 3  # type: ignore[assignment]
        elif d == "overlap":
            c = pick()
            assert c is not None
            dup = ps_pb2.Chunk()
            dup.CopyFrom(c)
            damaged.add(id(dup))
            chunks.insert(src.integer(0, len(chunks)), dup)
        defects.append(d)
    if not defects:  # every defect drawn was inapplicable: refuse by an unregistered worker
        header["worker_id"] = -1
        defects.append("unregistered_worker")
    # Framed as the worker frames it half the time: ends_with_last on every message, last on the final one,
    # which alone may raise found_inf (a streaming worker learns at the end of backward).
    ends = src.boolean()
    if ends:
        header["ends_with_last"] = True
    messages = [ps_pb2.PushRequest(**header)] if chunks and src.integer(0, 3) == 0 else []  # a header alone first
    messages += [ps_pb2.PushRequest(**header, chunk=c) for c in chunks] or [ps_pb2.PushRequest(**header)]
    if ends and src.boolean():  # a header-only last message
        messages.append(ps_pb2.PushRequest(**header))
    if ends:
        messages[-1].last = True
        if not header["found_inf"] and src.boolean():
            messages[-1].found_inf = True  # allowed: not a defect
    if "mixed_headers" in defects:
        other = dict(header)
        key = src.choice(["worker_id", "step", "base_version", "found_inf", "loss_scale", "sync_switch"])
        if key == "found_inf":
            other[key] = not header[key]
        elif key == "loss_scale":
            other[key] = 0.0 if header[key] != 0.0 else 1.0
        else:
            lo, hi = INT32 if key == "worker_id" else INT64
            v = wild_int(src, lo, hi)
            other[key] = v if v != header.get(key, 0) else (v + 1 if v < hi else v - 1)
        extra = ps_pb2.PushRequest(**other, chunk=src.choice(chunks)) if chunks and src.boolean() \
            else ps_pb2.PushRequest(**other)
        if ends and key == "found_inf" and header["found_inf"]:
            extra.last = True  # the last message lowers it: refused (only raising it is allowed)
            messages[-1].last = False
            messages.append(extra)
        elif ends:  # after the first message (which sets the header) and before the last (which may raise
            # found_inf: a stream that ends_with_last may not end on the odd one)
            if len(messages) == 1:
                messages.insert(0, ps_pb2.PushRequest(**header))
            messages.insert(src.integer(1, len(messages) - 1), extra)
        else:
            messages.insert(src.integer(1, len(messages)), extra)
    if "empty_stream" in defects:
        messages = []
    return Case("push", "Push", sh.index, messages=messages, defects=tuple(defects))
