"""Tensor <-> wire chunks: raw little-endian bytes, never pickle.

A chunk covers a flat element range of a row-major tensor. ``encode_range``
cuts a range into pieces of at most ``chunk_bytes``; ``decode`` turns a
payload back into a 1-D tensor that shares the payload's memory.
"""

from __future__ import annotations

import ctypes
import math
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.sizes import DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES  # (re-exported: here they were first)
from shardps.protos.sizes import MAX_CHUNK_BYTES as MAX_CHUNK_BYTES

if sys.byteorder != "little":  # pragma: no cover - no such machine in CI
    raise ImportError("shardps's wire format is little-endian; big-endian hosts are not supported")

# torch.frombuffer warns that protobuf's bytes are read-only; decoded chunks
# are only ever read (copied into staging or parameters), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_TO_TORCH: dict[int, torch.dtype] = {
    ps_pb2.FLOAT32: torch.float32,
    ps_pb2.FLOAT16: torch.float16,
    ps_pb2.BFLOAT16: torch.bfloat16,
}
_TO_WIRE: dict[torch.dtype, int] = {v: k for k, v in _TO_TORCH.items()}
DTYPE_NAMES: dict[int, str] = {
    ps_pb2.FLOAT32: "float32",
    ps_pb2.FLOAT16: "float16",
    ps_pb2.BFLOAT16: "bfloat16",
}


def to_wire_dtype(dtype: torch.dtype) -> int:
    """The proto enum for a torch dtype; ValueError for unsupported ones."""
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype}: shardps carries float32, float16 and bfloat16"
        ) from None


def to_torch_dtype(wire: int) -> torch.dtype:
    """The torch dtype for a proto enum value; ValueError for unknown ones."""
    try:
        return _TO_TORCH[wire]
    except KeyError:
        raise ValueError(
            f"unsupported wire dtype {wire}: expected one of {sorted(DTYPE_NAMES.values())}"
        ) from None


def dtype_name(wire: int) -> str:
    return DTYPE_NAMES.get(wire, f"<unknown dtype {wire}>")


def check_chunk_bytes(chunk_bytes: int) -> int:
    if not 1024 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1024, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    return chunk_bytes


def encode_range(
    flat: torch.Tensor, start: int, stop: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, payload)`` pieces covering ``flat[start:stop]``.

    ``flat`` is a contiguous 1-D CPU tensor; each payload is one copy of its
    elements' bytes. An empty range yields nothing.
    """
    step = max(1, chunk_bytes // flat.element_size())
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    size = flat.element_size()
    for a in range(start, stop, step):
        b = min(stop, a + step)
        yield a, raw[a * size : b * size].numpy().tobytes()


def tensor_memory(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable memoryview, without a copy (bf16 too) and without
    ``Tensor.numpy()``, which marks the tensor's storage not resizable for good: a streamed worker frees
    and reallocates its parameters' storage with ``resize_`` (worker/streaming/streamer.py), so a pull read
    straight into a parameter must leave it as it was. The view keeps ``t`` alive."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"tensor_memory: a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    raw._tensor = t  # type: ignore[attr-defined]  # the memory lives as long as the view (which holds raw)
    return memoryview(raw).cast("B")


def decode(data: bytes | memoryview, wire_dtype: int) -> torch.Tensor:
    """A read-only 1-D tensor viewing ``data``; ValueError if it does not fit."""
    dtype = to_torch_dtype(wire_dtype)
    size = dtype.itemsize
    if len(data) % size:
        raise ValueError(
            f"payload of {len(data)} bytes is not a whole number of {dtype_name(wire_dtype)} elements"
        )
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def itemsize(wire_dtype: int) -> int:
    return to_torch_dtype(wire_dtype).itemsize


_NUMPY_SUMS = (torch.float32, torch.float64)
ONE_THREAD_SUM_BYTES = 16 << 20
"""``all_finite`` sums a CPU fp32/fp64 tensor up to this size in the calling thread (numpy), not in torch's
pool of threads: after each parallel region those threads spin, waiting for the next, and a data path's
checks come one by one between socket calls (a quarter to a third of the data connection's CPU per byte in
``benchmarks/tcppath.py`` was a worker's pool spinning after its checks; docs/performance.md). A larger one
is summed in parallel: its work outweighs the spin, and its wall time counts."""


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no inf and no nan. Exact.

    Usually one read-only pass, the sum: IEEE addition keeps an inf (inf +
    -inf is nan) and a nan, so a finite sum means every element is finite.
    Finite values can also sum to inf (huge values, or a float16 sum past
    65504): a non-finite sum is confirmed with min/max (nan propagates
    through both, an inf is one of them). The sum is about 4x faster than
    min/max on CPU, which is itself much faster than ``isfinite(t).all()``.
    Up to ``ONE_THREAD_SUM_BYTES`` of CPU fp32/fp64 the sum is numpy's, in this thread.
    """
    if t.numel() == 0:
        return True
    flat = t if t.dim() == 1 else t.reshape(-1)
    if (flat.dtype in _NUMPY_SUMS and flat.device.type == "cpu" and flat.is_contiguous()
            and flat.numel() * flat.element_size() <= ONE_THREAD_SUM_BYTES):
        values = (flat.detach() if flat.requires_grad else flat).numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # an inf or nan is the answer, not a warning
            if math.isfinite(values.sum()):
                return True
    elif math.isfinite(flat.sum().item()):
        return True
    lo, hi = torch.aminmax(flat)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())
