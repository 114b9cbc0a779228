"""From the wire to the store's calls and back: the streamed requests decoded, the answers encoded.

Each servicer handler (service.py) is a decode from here, one call on the
store, and an encode. Decoding validates all it can without the store's
state (shapes, dtypes, chunk coverage, mixed headers, option ranges), so a
malformed request is refused with INVALID_ARGUMENT before the store is
touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardps.protos import codec, framing, shm
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.assembly import ChunkAssembler
from shardps.server.datapath.headers import check_continuation, check_header, mixed
from shardps.server.datapath.shm import Segments
from shardps.server.datapath.slicepull import named_slices
from shardps.server.datapath.slicepush import SlicedLookup
from shardps.server.errors import InvalidArgument
from shardps.server.scaling import LossScaler
from shardps.server.sync import Grad, PartKey
from shardps.server.table import TensorSpec

#: What every message of a Push stream repeats. ``chunk`` and ``last`` are each message's own; ``found_inf``
#: is the header's too, but the last message of a stream that ends_with_last may raise it (``decode_push``).
PUSH_HEADER = ("worker_id", "step", "base_version", "loss_scale", "epoch", "shm", "ends_with_last", "pull_after",
               "pull_dtype", "pull_min_clock", "slices", "sync", "sync_switch", "fence_epoch")


def scaler_from_wire(msg: ps_pb2.LossScaling) -> LossScaler | None:
    if not msg.enabled:
        return None
    try:
        return LossScaler(init_scale=msg.init_scale, growth_factor=msg.growth_factor,
                          backoff_factor=msg.backoff_factor, growth_interval=msg.growth_interval)
    except ValueError as e:
        raise InvalidArgument(f"loss scaling: {e}") from None


@dataclass
class Join:
    """A decoded Register: the job's settings, the worker, its tensors and (worker 0) their initial values."""

    worker_id: int
    num_workers: int
    sync: str
    scaling: LossScaler | None
    remedy: str
    specs: list[TensorSpec]
    values: dict[PartKey, torch.Tensor] | None  # None: wait for another worker to create the tensors
    shm: bool = False  # the worker's shared-memory probe was read here: the same-host fast path works


#: What a later message of a Register stream carries (its other fields, if set, must be the first's).
REGISTER_OWN = frozenset({"chunk"})


def decode_register(requests: Iterator[ps_pb2.RegisterRequest]) -> Join:
    first = next(requests, None)
    if first is None:
        raise InvalidArgument("Register stream was empty")
    specs = [TensorSpec.from_proto(t) for t in first.tensors]
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs):
        raise InvalidArgument("Register names a tensor more than once")

    def lookup(name: str) -> TensorSpec:
        s = by_name.get(name)
        if s is None:
            raise InvalidArgument(f"initial values for tensor {name!r}, which this Register does not declare")
        return s

    values = None
    if first.provides_values:
        asm = ChunkAssembler(lookup, what="initial value")
        if first.HasField("chunk"):
            asm.add(first.chunk)
        for i, req in enumerate(requests, start=2):
            check_continuation("Register", i, first, req, REGISTER_OWN)
            asm.add(req.chunk)
        values = asm.finish_staged()
    else:
        for _ in requests:
            raise InvalidArgument("chunks sent in a Register without provides_values")
    return Join(first.worker_id, first.num_workers, first.sync, scaler_from_wire(first.loss_scaling),
                first.staleness_remedy, specs, values, shm.read_probe(first.shm_probe, first.shm_token))


@dataclass
class Gradients:
    """A decoded Push: one worker's gradients for one step, assembled into fp32 parts."""

    worker_id: int
    step: int
    base_version: int
    grads: dict[PartKey, Grad]  # fp32 staging buffers, or (keep_chunks) fp32 parts still in their chunks
    nbytes: int
    found_inf: bool  # said in any message of the stream, or a chunk held an inf/nan (with a loss_scale: left
    # to the unscaling)
    loss_scale: float
    epoch: int
    pull_after: PullAfter | None = None  # answer with the weights too, when they are ready at once
    weights: dict[PartKey, int] | None = None  # a sliced Push: the gradients each part counts for (slicepush.py)
    sync: str = ""  # the mode the worker ran the step under, and the job's sync switch it came from
    sync_switch: int = 0
    fence_epoch: int = 0  # the shard's fencing epoch the worker knows (--coordinator; 0: none)


@dataclass(frozen=True)
class PullAfter:
    """What a Push asks to get back with its answer (``PushRequest.pull_after``)."""

    wire_dtype: int | None  # None: each tensor's own dtype
    min_clock: int


def decode_push(requests: Iterator[ps_pb2.PushRequest], lookup: Callable[[str], TensorSpec],
                alloc: Callable[[PartKey, int], torch.Tensor] | None = None,
                segments: Segments | None = None,
                keep_chunks: Callable[[float], bool] | None = None) -> Gradients:
    """``lookup``: the shard's spec of a tensor (NotFound for others); ``alloc``: its staging buffers;
    ``segments``: the workers' shared-memory segments, for a Push whose chunks lie there (``shm``);
    ``keep_chunks(loss_scale)``: whether to keep fp32 chunks as received (``ShardStore.takes_chunked``).

    Every path that reads a Push comes here: the stream, the one-message
    unary handler, the same-host path (chunks in shared memory). Every
    message carries the same header (``PUSH_HEADER`` and ``found_inf``), or
    the stream is refused (INVALID_ARGUMENT naming the field and both
    values); nothing is handed on before the last message is in and valid.
    One exception: a worker that streams its gradient while backward still
    runs learns only at the end whether any of it (on any shard) held an
    inf/nan, so the last message of a stream that ``ends_with_last`` may
    raise ``found_inf`` (never lower it).
    """
    first = next(requests, None)
    if first is None:
        raise InvalidArgument("Push stream was empty")
    keep = keep_chunks is not None and keep_chunks(first.loss_scale)
    sliced = None
    if first.slices:  # a tensor-parallel rank's slices (server/datapath/slicepush.py): assembled as the slices they are
        lookup = sliced = SlicedLookup(lookup, named_slices(first.slices, "Push"))
        alloc, keep = None, False
    # A scaled gradient is checked by ShardStore.submit as it unscales it (one pass for both): not here too.
    asm = ChunkAssembler(lookup, what="gradient", alloc=alloc, keep_chunks=keep, check=not first.loss_scale)
    found_inf = first.found_inf
    ended = first.last

    def chunk(req: ps_pb2.PushRequest) -> Any:
        c = req.chunk
        if not req.shm or c.encoding != ps_pb2.DENSE:  # a compressed chunk carries its bytes (compressed.check)
            return c
        if segments is None:
            raise InvalidArgument("Push names a shared-memory segment, but this server does not take them")
        if c.data:
            raise InvalidArgument(f"tensor {c.name!r}: a chunk carries data and a shared-memory range at once")
        return framing.ChunkView(c, segments.view(req.worker_id, req.shm, c.shm_offset, c.shm_bytes, c.name))

    if first.HasField("chunk"):  # a header alone: no gradients this step
        asm.add(chunk(first))
    for i, req in enumerate(requests, start=2):
        check_header("Push", i, first, req, PUSH_HEADER)
        if ended:
            raise InvalidArgument(f"Push stream of worker {first.worker_id} goes on after its last message")
        ended = req.last
        if req.found_inf != first.found_inf and not (first.ends_with_last and ended and req.found_inf):
            raise mixed("Push", i, "found_inf", first.found_inf, req.found_inf,
                        " (only the last message of a stream that ends_with_last may raise it)")
        found_inf = found_inf or req.found_inf
        if req.HasField("chunk"):
            asm.add(chunk(req))
    if first.ends_with_last and not ended:
        raise InvalidArgument(f"Push stream of worker {first.worker_id}, step {first.step} ended before its last "
                              f"message (cancelled, or the worker died): nothing of it is applied")
    grads = asm.finish()
    weights = None
    if sliced is not None:
        grads, weights = sliced.place(grads)
    pull_after = None
    if first.pull_after:
        pull_after = PullAfter(_wire_dtype(first.pull_dtype, "Push"), first.pull_min_clock)
    return Gradients(first.worker_id, first.step, first.base_version, grads, asm.nbytes,
                     found_inf or not asm.all_finite, first.loss_scale, first.epoch, pull_after, weights,
                     first.sync, first.sync_switch, first.fence_epoch)


def _chunk_bytes(requested: int, default: int, rpc: str) -> int:
    chunk_bytes = requested or default
    try:
        return codec.check_chunk_bytes(chunk_bytes)
    except ValueError as e:
        raise InvalidArgument(f"{rpc}: {e}") from None


@dataclass
class PullQuery:
    """A decoded Pull: which weights, in which dtype and chunks, and what to wait for first."""

    worker_id: int
    names: list[str]  # empty: every tensor of the shard
    wire_dtype: int | None  # None: each tensor's own dtype
    chunk_bytes: int
    min_version: int
    min_clock: int
    epoch: int
    segment: shm.Segment | None = None  # write the weights there (the same-host fast path)


def _wire_dtype(dtype: int, rpc: str) -> int | None:
    """A requested wire dtype (None: each tensor's own); INVALID_ARGUMENT for one that is not a dtype."""
    if dtype == ps_pb2.DTYPE_UNSPECIFIED:
        return None
    try:
        codec.to_torch_dtype(dtype)
    except ValueError as e:
        raise InvalidArgument(f"{rpc}: {e}") from None
    return int(dtype)


def decode_pull(request: ps_pb2.PullRequest, default_chunk_bytes: int,
                segments: Segments | None = None) -> PullQuery:
    wire = _wire_dtype(request.dtype, "Pull")
    seg = None
    if request.shm:
        if segments is None:
            raise InvalidArgument("Pull names a shared-memory segment, but this server does not take them")
        seg = segments.get(request.worker_id, request.shm)
    return PullQuery(request.worker_id, list(request.names), wire,
                     _chunk_bytes(request.chunk_bytes, default_chunk_bytes, "Pull"),
                     request.min_version, request.min_clock, request.epoch, seg)


def encode_state(version: int, items: Sequence[tuple[str, int, int, str, torch.Tensor]],
                 chunk_bytes: int) -> Iterator[ps_pb2.StateChunk]:
    """``ShardStore.export_state``'s copy as PullState chunks."""
    for name, start, stop, key, t in items:
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        shape = list(t.shape)  # [] for a 0-d tensor: the first chunk (offset 0) is authoritative
        wire = codec.to_wire_dtype(flat.dtype)
        for off, payload in codec.encode_range(flat, 0, flat.numel(), chunk_bytes):
            yield ps_pb2.StateChunk(
                version=version, name=name, part_start=start, part_stop=stop, key=key,
                shape=shape if off == 0 else [],
                chunk=ps_pb2.Chunk(name=key, offset=off, dtype=wire, data=payload))  # type: ignore[arg-type]


def state_chunk_bytes(request: ps_pb2.PullStateRequest, default_chunk_bytes: int) -> int:
    return _chunk_bytes(request.chunk_bytes, default_chunk_bytes, "PullState")
