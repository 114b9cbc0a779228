"""A Pull that names slices (``PullRequest.slices``): each of those tensors' slice only, gathered by the shard.

A tensor-parallel rank holds ``torch.chunk(t, p, dim)[rank]`` of a whole tensor ``t`` the shards hold
(docs/tensor-parallel.md); it asks for that slice by ``(dim, parts, index, blocks)``
(protos/slices.py) and the shard answers with the slice's elements its parts hold, chunk offsets and the
shape (on the tensor's first chunk) the slice's. Along dim 0 the elements are flat ranges of the parts;
along a later dim the shard gathers them from every row of its parts, so no whole row crosses the wire.
Tensors in ``names`` come whole as in any Pull. The slices are copied under the store's lock (one
version's, once no step is in flight: ``Reader.read_copies``) and framed outside it; the copy is the
slice's bytes, as small as the answer. Where the Pull names a segment (the worker's shared-memory pull
segment, or its frame's pull buffer on a data connection), the bytes are written there, each part's runs one
after another from the part's 64-byte boundary (they fit where the part itself would), and each message
says where; else they travel in the messages. A sliced Pull is not cached (each rank asks its own slice).

A slice that does not fit its tensor (a dim out of range, parts < 1, an index outside [0, parts), blocks
that do not divide the dim), a tensor named twice, or a segment too small for the answer is
INVALID_ARGUMENT, naming the tensor (or segment), the expected and the received, before any wait (a segment
too small: before any byte is written); nothing changes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from shardps.protos import codec, framing, shm
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.server.datapath.reader import Reader
from shardps.server.errors import InvalidArgument
from shardps.server.table import TensorEntry, TensorSpec, TensorTable

Run = tuple[str, int, tuple[int, ...], int, int, torch.Tensor]  # (name, wire dtype, shape, part, offset, values)


def named_slices(slices: Iterable[ps_pb2.TensorSlice], rpc: str, whole: Collection[str] = ()) -> dict[str, TensorSlice]:
    """The slices a request names, by tensor; INVALID_ARGUMENT for a tensor named twice (or in ``whole`` too)."""
    out: dict[str, TensorSlice] = {}
    for s in slices:
        if s.name in out or s.name in whole:
            raise InvalidArgument(f"{rpc}: tensor {s.name!r} is asked for more than once (expected each tensor "
                                  f"once, whole or as one slice)")
        out[s.name] = TensorSlice(s.dim, s.parts, s.index, s.blocks or 1)
    return out


def decode_slices(request: ps_pb2.PullRequest) -> dict[str, TensorSlice]:
    """The slices a Pull names, by tensor; INVALID_ARGUMENT for a tensor named twice."""
    return named_slices(request.slices, "Pull", set(request.names))


def check_slice(rpc: str, spec: TensorSpec, sl: TensorSlice) -> None:
    """INVALID_ARGUMENT unless ``sl`` fits the tensor of ``spec`` (and its parts here are whole units of the
    sliced dims), naming the tensor, the expected and the received."""
    problem = sl.problem(spec.shape)
    if not problem:
        try:
            for start, stop in spec.parts:
                sl.pieces(spec.shape, start, stop)
        except ValueError as e:
            problem = f"this shard's part is not whole rows of the slice: {e}"
    if problem:
        raise InvalidArgument(f"{rpc}: slice (dim {sl.dim}, parts {sl.parts}, index {sl.index}, blocks "
                              f"{sl.blocks}) of tensor {spec.name!r} (shape {list(spec.shape)}): {problem}")


def check_slices(table: TensorTable, names: Sequence[str], slices: Mapping[str, TensorSlice]) -> None:
    """Under the store's lock: NOT_FOUND for a tensor not held, INVALID_ARGUMENT for a slice that does not fit
    its tensor (``check_slice``)."""
    for n in names:
        table.spec(n)
    for n, sl in slices.items():
        check_slice("Pull", table.spec(n), sl)


def _copy(entries: list[TensorEntry], slices: Mapping[str, TensorSlice],
          wire_dtype: int | None) -> tuple[list[Run], int]:
    """Under the lock: each entry's elements asked (its slice's, or all), cast to the wire dtype; the bytes."""
    out: list[Run] = []
    nbytes = 0
    for e in entries:
        dt = e.spec.dtype if wire_dtype is None else wire_dtype
        tdt = codec.to_torch_dtype(dt)
        sl = slices.get(e.spec.name)
        shape = sl.shape(e.spec.shape) if sl is not None else e.spec.shape
        for start in sorted(e.parts):
            w = e.parts[start].weight.reshape(-1)
            runs = sl.take(e.spec.shape, start, w) if sl is not None else [(start, w.clone())]
            for at, flat in runs:
                flat = flat.to(tdt)
                out.append((e.spec.name, dt, shape, start, at, flat))
                nbytes += flat.numel() * flat.element_size()
    return out, nbytes


def read_slices(reader: Reader, table: TensorTable, names: Sequence[str], slices: Mapping[str, TensorSlice],
                wire_dtype: int | None, chunk_bytes: int, *, slowest_clock: int = 0,
                worker_id: int | None = None, segment: shm.Segment | None = None) -> list[bytes]:
    """The PullResponse messages of a sliced Pull (see the module docstring), of one version; ``segment``: where
    their bytes go (the messages then say where), else in the messages."""

    def copy(entries: list[TensorEntry]) -> tuple[tuple[list[Run], list[int]], int]:
        runs, nbytes = _copy(entries, slices, wire_dtype)
        return (runs, _places(runs, segment) if segment is not None else []), nbytes

    version, loss_scale, sync, (runs, places) = reader.read_copies(
        [*names, *slices], worker_id, copy, check=lambda: check_slices(table, names, slices))
    if segment is not None:
        return _into(segment, runs, places, version, loss_scale, sync, slowest_clock)
    prefix, suffix = framing.pull_header(version, loss_scale, sync, slowest_clock)
    messages: list[bytes] = []
    shaped: set[str] = set()
    for name, dt, shape, _, at, flat in runs:
        first: Sequence[int] = shape if name not in shaped else ()
        shaped.add(name)
        for _, _, msg in framing.chunk_messages(prefix, framing.PULL_CHUNK_FIELD, suffix, name, dt, first, flat,
                                                0, flat.numel(), chunk_bytes, base=at):
            messages.append(msg)
            first = ()
    return messages


def _places(runs: list[Run], segment: shm.Segment) -> list[int]:
    """Where each run goes in ``segment``: each part's runs one after another from the part's 64-byte boundary;
    INVALID_ARGUMENT (before anything is counted or written) when the segment is too small."""
    places: list[int] = []
    at, part = 0, ("", -1)
    for name, _, _, start, _, flat in runs:
        if (name, start) != part:
            at, part = shm.aligned(at), (name, start)
        places.append(at)
        at += flat.numel() * flat.element_size()
    if at > segment.size:
        raise InvalidArgument(f"Pull: segment {segment.name} holds {segment.size} bytes; the slices asked need {at}")
    return places


def _into(segment: shm.Segment, runs: list[Run], places: list[int], version: int, loss_scale: float, sync: str,
          slowest_clock: int) -> list[bytes]:
    """``runs`` written into ``segment`` at ``places``, one PullResponse per run saying where."""
    messages: list[bytes] = []
    shaped: set[str] = set()
    for (name, dt, shape, _, offset, flat), off in zip(runs, places, strict=True):
        nbytes = flat.numel() * flat.element_size()
        if nbytes:
            torch.frombuffer(segment.view(off, nbytes), dtype=flat.dtype).copy_(flat)
        messages.append(ps_pb2.PullResponse(
            version=version, loss_scale=loss_scale, sync=sync, slowest_clock=slowest_clock,
            chunk=ps_pb2.Chunk(name=name, offset=offset, dtype=dt,  # type: ignore[arg-type]
                               shape=shape if name not in shaped else (), shm_offset=off,
                               shm_bytes=nbytes)).SerializeToString())
        shaped.add(name)
    return messages
