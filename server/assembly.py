"""Turning a stream of chunks into whole fp32 parts, validating every chunk.

Used for pushed gradients and for initial values at registration. Nothing
here touches the store's state: a stream that fails validation is dropped
with an error that names the tensor, what was expected and what came.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from shardps.protos import codec
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.errors import InvalidArgument, ResourceExhausted
from shardps.server.sync import PartKey
from shardps.server.table import TensorSpec, fmt_shape

#: Largest part (in elements) a shard accepts: 16 GiB of fp32.
MAX_PART_ELEMENTS = 1 << 32


class ChunkAssembler:
    """Collects chunks into one fp32 staging buffer per part.

    ``lookup(name)`` returns the spec the chunks must match (raising
    NotFound for unknown names); ``alloc(key, numel)`` gives staging buffers
    (the store recycles them: fresh pages cost more than the copy). Every part of a tensor that appears must
    be covered exactly once by the time ``finish`` is called.
    """

    def __init__(self, lookup: Callable[[str], TensorSpec], what: str = "gradient",
                 alloc: Callable[[PartKey, int], torch.Tensor] | None = None) -> None:
        self._lookup = lookup
        self._alloc = alloc or (lambda key, n: torch.empty(n, dtype=torch.float32))
        self._what = what
        self._gradient = what == "gradient"  # gradients travel in the spec's grad dtype
        self._specs: dict[str, TensorSpec] = {}
        self._starts: dict[str, list[int]] = {}
        self._stops: dict[str, dict[int, int]] = {}
        self._buffers: dict[PartKey, torch.Tensor] = {}
        self._covered: dict[PartKey, list[tuple[int, int]]] = {}
        self.all_finite = True  # gradients: no inf/nan in any chunk so far
        self.nbytes = 0

    def add(self, chunk: ps_pb2.Chunk) -> None:
        name = chunk.name
        spec = self._specs.get(name)
        if spec is None:
            spec = self._lookup(name)
            self._specs[name] = spec
            self._starts[name] = sorted(a for a, _ in spec.parts)
            self._stops[name] = dict(spec.parts)
        expected = spec.push_dtype if self._gradient else spec.dtype
        if chunk.dtype != expected:
            raise InvalidArgument(
                f"tensor {name!r}: {self._what} dtype expected {codec.dtype_name(expected)}, "
                f"got {codec.dtype_name(chunk.dtype)}"
            )
        if chunk.shape and tuple(chunk.shape) != spec.shape:
            raise InvalidArgument(
                f"tensor {name!r}: {self._what} shape expected {fmt_shape(spec.shape)}, "
                f"got {fmt_shape(tuple(chunk.shape))}"
            )
        try:
            values = codec.decode(chunk.data, chunk.dtype)
        except ValueError as e:
            raise InvalidArgument(f"tensor {name!r}: {e}") from None
        n = values.numel()
        a = chunk.offset
        if n == 0:
            raise InvalidArgument(f"tensor {name!r}: empty chunk at offset {a}")
        starts = self._starts[name]
        i = bisect.bisect_right(starts, a) - 1
        part = self._stops[name].get(starts[i]) if i >= 0 else None
        if part is None or not (starts[i] <= a and a + n <= part):
            raise InvalidArgument(
                f"tensor {name!r}: chunk [{a}, {a + n}) is out of range: shard owns "
                f"{sorted(spec.parts)[:4]}{'...' if len(spec.parts) > 4 else ''} of "
                f"{spec.numel} elements (shape {fmt_shape(spec.shape)})"
            )
        start = starts[i]
        key = (name, start)
        buf = self._buffers.get(key)
        if buf is None:
            if part - start > MAX_PART_ELEMENTS:
                raise ResourceExhausted(f"tensor {name!r}: part [{start}, {part}) of {part - start} elements is "
                                        f"over the {MAX_PART_ELEMENTS} a shard takes")
            try:
                buf = self._alloc(key, part - start)
            except RuntimeError as e:  # the allocation failed: out of memory
                raise ResourceExhausted(f"tensor {name!r}: cannot allocate {part - start} elements: {e}") from None
            self._buffers[key] = buf
            self._covered[key] = []
        if self._gradient and self.all_finite and not codec.all_finite(values):
            self.all_finite = False  # checked while the chunk is in cache, not in a pass of its own later
        buf[a - start : a - start + n].copy_(values)
        self._covered[key].append((a, a + n))
        self.nbytes += len(chunk.data)

    def finish(self) -> dict[PartKey, torch.Tensor]:
        """The staged parts; InvalidArgument if any part is partly covered or overlapped."""
        for name, spec in self._specs.items():
            for a, b in spec.parts:
                ranges = sorted(self._covered.get((name, a), []))
                pos = a
                for x, y in ranges:
                    if x != pos:
                        kind = "overlapping" if x < pos else "missing"
                        raise InvalidArgument(
                            f"tensor {name!r}: {self._what} has {kind} elements at {min(x, pos)} "
                            f"in part [{a}, {b})"
                        )
                    pos = y
                if pos != b:
                    raise InvalidArgument(
                        f"tensor {name!r}: {self._what} covers {pos - a} of the {b - a} elements "
                        f"of part [{a}, {b})"
                    )
        return self._buffers
