"""Compressed gradient chunks: the encodings a worker sends and a shard expands (``Chunk.encoding``).

A compressed chunk stands for the flat element range ``[offset, offset +
numel)`` of its tensor, like a dense chunk for ``[offset, offset +
len(data) / itemsize)``, so a shard checks coverage the same way for both.
What it carries (docs/compression.md):

- ``TOPK``: ``data`` holds ``count`` values in the chunk's dtype and
  ``indices`` their positions in the range (relative to ``offset``,
  strictly ascending: no duplicate to sum or to choose between), int32
  (``INT32_SPAN``: int64 for a range of more elements); the rest is 0.
- ``LOWRANK``: the range is whole rows of the tensor's ``[rows, cols]``
  view (``cols``: the product of its shape but the first dimension); it
  is ``P @ Q.T``, ``P`` (rows x rank) in ``data`` and ``Q`` (cols x rank)
  in ``factor``, row-major, in the chunk's dtype.

``check`` and ``expand`` are the shard's: ``check`` validates every field
against the tensor's shape (ValueError saying what was expected and what
came), ``expand`` writes the dense fp32 values. The worker builds its
chunks from the same definitions and expands what it sends with the same
``topk_into`` / ``lowrank_into``, so its error feedback subtracts exactly
what the shard will add.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardps.protos import codec
from shardps.protos.shardps.v1 import ps_pb2

DENSE = ps_pb2.DENSE
TOPK = ps_pb2.TOPK
LOWRANK = ps_pb2.LOWRANK
NAMES: dict[int, str] = {DENSE: "dense", TOPK: "topk", LOWRANK: "lowrank"}
INT32_SPAN = 1 << 31  # a TOPK range of up to this many elements has int32 indices, a longer one int64
MAX_RANK = 1024  # a LOWRANK chunk's rank at most: bounds a shard's work per element expanded


def encoding_name(encoding: int) -> str:
    return NAMES.get(encoding, f"<unknown encoding {encoding}>")


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a TOPK chunk's indices for a range of ``numel`` elements."""
    return torch.int32 if numel <= INT32_SPAN else torch.int64


def columns(shape: Sequence[int]) -> int:
    """The columns of a tensor's matrix view ``[shape[0], -1]`` (LOWRANK); 0 for a tensor of rank < 2."""
    return math.prod(shape[1:]) if len(shape) >= 2 else 0


def span(chunk: Any) -> int:
    """How many elements of the flat tensor a chunk stands for (a DENSE one: its data's whole elements)."""
    if chunk.encoding == DENSE:
        return len(chunk.data) // codec.itemsize(chunk.dtype)
    return int(chunk.numel)


def check(chunk: Any, shape: Sequence[int]) -> None:
    """ValueError unless ``chunk`` (its dtype already checked) is a well-formed chunk of a tensor of ``shape``.

    Checks the fields each encoding uses and that the others are unset,
    sizes, index order and range, and LOWRANK's row alignment; the range
    itself (inside a part of the shard) is the caller's to check.
    """
    enc = chunk.encoding
    if enc == DENSE:
        if chunk.numel or chunk.indices or chunk.rank or chunk.factor:
            raise ValueError("a dense chunk carries numel, indices, rank or factor")
        return
    if enc not in (TOPK, LOWRANK):
        raise ValueError(f"encoding expected one of {sorted(NAMES.values())}, got {encoding_name(enc)}")
    if chunk.shm_offset or chunk.shm_bytes:
        raise ValueError(f"a {encoding_name(enc)} chunk lies in shared memory: compressed chunks carry their bytes")
    numel, size = int(chunk.numel), codec.itemsize(chunk.dtype)
    if numel <= 0:
        raise ValueError(f"a {encoding_name(enc)} chunk stands for numel > 0 elements, got {numel}")
    if len(chunk.data) % size:
        raise ValueError(f"data of {len(chunk.data)} bytes is not a whole number of "
                         f"{codec.dtype_name(chunk.dtype)} elements")
    if enc == TOPK:
        if chunk.rank or chunk.factor:
            raise ValueError("a topk chunk carries rank or factor")
        count = len(chunk.data) // size
        width = index_dtype(numel).itemsize
        if count > numel:
            raise ValueError(f"topk: {count} values for a range of {numel} elements")
        if len(chunk.indices) != count * width:
            raise ValueError(f"topk: indices expected {count * width} bytes ({count} x int{8 * width}), "
                             f"got {len(chunk.indices)}")
        if count:
            idx = torch.frombuffer(chunk.indices, dtype=index_dtype(numel))
            lo, hi = int(idx[0]), int(idx[-1])
            if lo < 0 or hi >= numel:
                raise ValueError(f"topk: indices expected in [0, {numel}), got [{lo}, {hi}]")
            if count > 1 and not bool((idx[1:] > idx[:-1]).all()):
                at = int((idx[1:] <= idx[:-1]).nonzero()[0]) + 1
                raise ValueError(f"topk: indices expected strictly ascending, got {int(idx[at])} after "
                                 f"{int(idx[at - 1])} at position {at}")
        return
    if chunk.indices:
        raise ValueError("a lowrank chunk carries indices")
    cols, rank = columns(shape), int(chunk.rank)
    if cols == 0:
        raise ValueError(f"lowrank: a tensor of shape {list(shape)} has no matrix view")
    if chunk.offset % cols or numel % cols:
        raise ValueError(f"lowrank: range [{chunk.offset}, {chunk.offset + numel}) is not whole rows of "
                         f"{cols} elements")
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"lowrank: rank expected in [1, {MAX_RANK}], got {rank}")
    rows = numel // cols
    if len(chunk.data) != rows * rank * size:
        raise ValueError(f"lowrank: data (P) expected {rows} x {rank} elements, got {len(chunk.data) // size}")
    if len(chunk.factor) != cols * rank * size:
        raise ValueError(f"lowrank: factor (Q) expected {cols} x {rank} elements, "
                         f"got {len(chunk.factor) / size:g}")


def topk_into(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out`` (fp32, the chunk's range) := 0 but ``values`` at ``indices``."""
    out.zero_()
    out.index_copy_(0, indices.long(), values.to(out.dtype))


def lowrank_into(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``out`` (fp32, the chunk's range of rows x cols elements) := ``P @ Q.T`` computed in fp32."""
    torch.matmul(p.to(out.dtype), q.to(out.dtype).T, out=out.view(p.shape[0], q.shape[0]))


def expand(chunk: Any, shape: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Write a checked compressed ``chunk`` of a tensor of ``shape`` into ``out`` (fp32, ``span(chunk)``
    elements); the values it carried, for the inf/nan check (LOWRANK: ``out``)."""
    dtype = codec.to_torch_dtype(chunk.dtype)
    values = codec.decode(chunk.data, chunk.dtype)
    if chunk.encoding == TOPK:
        topk_into(out, torch.frombuffer(chunk.indices, dtype=index_dtype(int(chunk.numel)))
                  if chunk.indices else torch.empty(0, dtype=torch.int64), values)
        return values
    cols, rank = columns(shape), int(chunk.rank)
    lowrank_into(out, values.view(-1, rank), torch.frombuffer(chunk.factor, dtype=dtype).view(cols, rank))
    return out


def payload_bytes(chunk: Any) -> int:
    """The bytes a chunk's values take (data, and a compressed chunk's indices and factor)."""
    return len(chunk.data) + len(chunk.indices) + len(chunk.factor)
