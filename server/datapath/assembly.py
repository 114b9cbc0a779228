"""Turning a stream of chunks into whole fp32 parts, validating every chunk.

Used for pushed gradients and for initial values at registration. Nothing
here touches the store's state: a stream that fails validation is dropped
with an error that names the tensor, what was expected and what came.

Each chunk is copied (cast to fp32 where it travels as bf16/fp16) into its
part's staging buffer (a compressed one expanded there: protos/compressed.py,
after every field was checked), and a gradient chunk is checked for inf/nan in that
copy while it is in cache. With ``keep_chunks``, fp32 gradient chunks are
not copied at all: the part is handed on as its chunks (``Chunked``, views
of the received messages), each checked as it arrives.

A Push that comes as a frame on a data connection (server/datapath/dataconn.py) may have
had its fp32 chunks read from the socket straight into their parts' staging
buffers (``landing``): such a chunk's bytes already lie where the copy would
put them, and are checked there as any other (every check of ``add`` runs,
nothing is skipped but the copy).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from shardps.protos import codec, compressed
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.errors import InvalidArgument, ResourceExhausted
from shardps.server.sync import Chunked, Grad, Grads, PartKey
from shardps.server.table import TensorSpec, fmt_shape

#: Largest part (in elements) a shard accepts: 16 GiB of fp32.
MAX_PART_ELEMENTS = 1 << 32


class ChunkAssembler:
    """Collects chunks into one fp32 staging buffer per part (or, ``keep_chunks``, keeps fp32 gradient chunks).

    ``lookup(name)`` returns the spec the chunks must match (raising
    NotFound for unknown names); ``alloc(key, numel)`` gives staging buffers
    (the store recycles them: fresh pages cost more than the copy). Every part of a tensor that appears must
    be covered exactly once by the time ``finish`` is called.
    """

    def __init__(self, lookup: Callable[[str], TensorSpec], what: str = "gradient",
                 alloc: Callable[[PartKey, int], torch.Tensor] | None = None, keep_chunks: bool = False,
                 check: bool = True) -> None:
        self._lookup = lookup
        self._alloc = alloc or (lambda key, n: torch.empty(n, dtype=torch.float32))
        self._what = what
        self._gradient = what == "gradient"  # gradients travel in the spec's grad dtype
        self._keep = keep_chunks and self._gradient
        self._check = check and self._gradient  # False: the caller checks (unscaling does, in the same pass)
        self._specs: dict[str, TensorSpec] = {}
        self._starts: dict[str, list[int]] = {}
        self._stops: dict[str, dict[int, int]] = {}
        self._buffers: dict[PartKey, torch.Tensor] = {}
        self._pieces: dict[PartKey, list[tuple[int, torch.Tensor]]] = {}  # keep_chunks: fp32 chunks as received
        self._covered: dict[PartKey, list[tuple[int, int]]] = {}
        self.all_finite = True  # gradients: no inf/nan in any chunk so far (if ``check``)
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
        data = chunk.data
        packed = chunk.encoding != compressed.DENSE
        if packed and not self._gradient:
            raise InvalidArgument(f"tensor {name!r}: {self._what} encoding expected dense, "
                                  f"got {compressed.encoding_name(chunk.encoding)}")
        try:
            compressed.check(chunk, spec.shape)
            values = codec.decode(data, chunk.dtype)
        except ValueError as e:
            raise InvalidArgument(f"tensor {name!r}: {e}") from None
        n = compressed.span(chunk) if packed else values.numel()
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
        covered = self._covered.get(key)
        if covered is None:
            if part - start > MAX_PART_ELEMENTS:
                raise ResourceExhausted(f"tensor {name!r}: part [{start}, {part}) of {part - start} elements is "
                                        f"over the {MAX_PART_ELEMENTS} a shard takes")
            covered = self._covered[key] = []
        if self._keep and values.dtype == torch.float32 and not packed:
            # Kept as received, checked now while the chunk is in cache (the step reads it later).
            if self._check and self.all_finite and not codec.all_finite(values):
                self.all_finite = False
            self._pieces.setdefault(key, []).append((a - start, values))
        else:
            buf = self._buffers.get(key)
            if buf is None:
                try:
                    buf = self._buffers[key] = self._alloc(key, part - start)
                except RuntimeError as e:  # the allocation failed: out of memory
                    raise ResourceExhausted(
                        f"tensor {name!r}: cannot allocate {part - start} elements: {e}") from None
            staged = buf[a - start : a - start + n]
            if packed:  # expanded into the staging buffer: what follows sees a dense gradient
                checked = compressed.expand(chunk, spec.shape, staged)
            else:
                if values.data_ptr() != staged.data_ptr():  # else read there from the socket (``landing``)
                    staged.copy_(values)
                checked = staged
            # Checked in the fp32 copy just written, while it is in cache: one more read, no second pass
            # over memory (and a float16 chunk's sum cannot overflow in fp32: no min/max to confirm it).
            if self._check and self.all_finite and not codec.all_finite(checked):
                self.all_finite = False
        covered.append((a, a + n))
        self.nbytes += compressed.payload_bytes(chunk) if packed else len(data)

    def _check_coverage(self) -> None:
        """InvalidArgument if any part is partly covered or overlapped."""
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

    def finish(self) -> dict[PartKey, Grad]:
        """Every part: its staging buffer, or its chunks as received; InvalidArgument as ``_check_coverage``."""
        self._check_coverage()
        out: dict[PartKey, Grad] = {}
        for key in self._covered:
            buf = self._buffers.get(key)
            if buf is not None:
                for at, values in self._pieces.get(key, ()):  # kept fp32 chunks beside compressed ones
                    buf[at : at + values.numel()].copy_(values)
                out[key] = buf
            else:
                name, start = key
                out[key] = Chunked(self._stops[name][start] - start, sorted(self._pieces[key], key=_offset))
        return out

    def finish_staged(self) -> Grads:
        """``finish`` for an assembler without ``keep_chunks``: every part in its staging buffer."""
        self._check_coverage()
        assert not self._pieces, "finish_staged: chunks were kept"
        return self._buffers


def _offset(piece: tuple[int, torch.Tensor]) -> int:
    return piece[0]


class Landing:
    """Where a framed Push's fp32 chunks may be read straight from the socket: ``regions`` (each chunk's offset
    in its frame -> the bytes of its place in its part's staging buffer) and those buffers (``take``, as the
    assembler's ``alloc``: a part with no landed chunk gets ``alloc``'s)."""

    def __init__(self, alloc: Callable[[PartKey, int], torch.Tensor]) -> None:
        self._alloc = alloc
        self.regions: dict[int, memoryview] = {}
        self.buffers: dict[PartKey, torch.Tensor] = {}

    def take(self, key: PartKey, numel: int) -> torch.Tensor:
        buf = self.buffers.pop(key, None)
        return buf if buf is not None and buf.numel() == numel else self._alloc(key, numel)


def landing(chunks: list[tuple[int, int, ps_pb2.Chunk]], lookup: Callable[[str], TensorSpec],
            alloc: Callable[[PartKey, int], torch.Tensor]) -> Landing:
    """The ``Landing`` of a framed Push's chunks (each chunk that names bytes of the frame: their offset,
    their length, the chunk). A chunk lands in its part's staging buffer (``alloc``'s) when it is dense fp32,
    the spec's push dtype, lies in one part of a tensor the shard holds, and no other chunk names any of its
    bytes; any other (a wrong dtype, an unknown tensor, a range no part holds, bytes two chunks name) is read
    into the frame's buffer as before, for ``ChunkAssembler.add`` to refuse or copy. Checks nothing it does
    not need: refusing is the assembler's."""
    out = Landing(alloc)
    views: dict[PartKey, memoryview] = {}
    spans = sorted((at, at + nbytes) for at, nbytes, _ in chunks)
    shared: set[int] = set()  # offsets of chunks whose bytes another chunk names too
    reach = -1  # the furthest end of the spans before
    for i, (a, b) in enumerate(spans):
        if a < reach or (i + 1 < len(spans) and spans[i + 1][0] < b):
            shared.add(a)
        reach = max(reach, b)
    for at, nbytes, c in chunks:
        if at in shared or c.encoding != ps_pb2.DENSE or c.dtype != ps_pb2.FLOAT32 or nbytes <= 0 or nbytes % 4:
            continue
        try:
            spec = lookup(c.name)
        except Exception:  # noqa: BLE001 - an unknown tensor: the assembler refuses it, naming it
            continue
        if spec.push_dtype != ps_pb2.FLOAT32:
            continue
        a, n = c.offset, nbytes // 4
        part = next(((start, stop) for start, stop in spec.parts if start <= a and a + n <= stop), None)
        if part is None or part[1] - part[0] > MAX_PART_ELEMENTS:
            continue
        key = (c.name, part[0])
        buf = out.buffers.get(key)
        if buf is None:
            buf = out.buffers[key] = alloc(key, part[1] - part[0])
            whole: Any = buf.numpy()
            views[key] = memoryview(whole).cast("B")  # the whole buffer's bytes: a slice costs no torch call
        at_byte = (a - part[0]) * 4
        out.regions[at] = views[key][at_byte : at_byte + nbytes]
    return out
