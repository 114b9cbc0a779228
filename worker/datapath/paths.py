"""How one shard's tensor bytes travel: a ``ShardPath``, on a data connection, with or without shared memory.

Every shard's Push and Pull calls are frames on this worker's one data
connection to the shard's server process (worker/datapath/dataconn.py,
``DataConn``). Where the bytes lie is the path's choice:

- ``ShmConnPath``: the shard shares this machine (it read the worker's probe
  at Register): the bytes lie in the shard's segments (``ShmPath``,
  ``worker/datapath/shm.py`` ``ShmLink``) and the messages only say where. A
  push first writes them there (``stage``: cast to the push dtype as they
  are copied, so a CPU gradient needs no cast of its own); should the
  segment close meanwhile (a fail-over in another thread), the call is made
  again on the shard's new path.
- ``ConnPath``: the bytes follow the messages in the same frame, sent from
  the gradient's memory, a pull's read straight into its destination.
- ``Pending``: the shard's connection is not made yet (a fail-over, a lost
  connection); its calls wait for it (``ShardPaths.ready``).

``ShardPaths`` (worker/datapath/shardpaths.py) holds one path per shard and is the one place the choice is
made: ``open`` after Register, ``moved`` when a shard fails over to its backup (``Transport.on_moved``),
``off`` when the client closes. The data path (``push.py``, ``bucketedpush.py``, ``pull.py``) takes a
shard's path as a call to it starts (``ShardPaths.ready``: a retry after a fail-over takes it anew), asks
it, and hands it to the transport with the call (``via=``: the path's ``calls`` make it); it never asks
which one it is. Every Push message is ``PushFramer``'s.

Thread-safety: a path's methods are called from the transport's threads, one
call per shard at a time; ``ShardPaths.off`` may run in any thread (a
fail-over): it swaps the list entry, then closes the old path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import grpc
import torch

from shardps.protos import codec
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.shm import SegmentClosed
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.reach import StatusError
from shardps.worker.datapath.shm import ShmLink
from shardps.worker.layout import Layout

if TYPE_CHECKING:
    pass

Staged = list[tuple[ps_pb2.Chunk, torch.Tensor]]
"""A shard's parts written ahead where it reads them: per part the chunk that says where, and the values."""

Frames = Callable[[str], PushFramer]
"""A plain push's framer for one shard, given the push segment its messages name."""


class SegmentParts:
    """A gradient as its shards' push segments hold it (``BucketedPush(hold_gradients=False)``): each part's
    values, in the push dtype, views of the segments that stay valid after a fail-over closes them (a view
    keeps its mapping). Sliced by part, as a path re-sending the stream on another road does
    (worker/datapath/dataconn.py ``ConnPath.bucket_messages``)."""

    def __init__(self, name: str, parts: dict[int, torch.Tensor]) -> None:
        self.name = name
        self._parts = parts  # the part's first element -> its values

    def __getitem__(self, key: slice) -> torch.Tensor:
        v = self._parts.get(key.start)
        if v is None or key.stop - key.start != v.numel():
            raise KeyError(f"gradient of {self.name!r}: [{key.start}, {key.stop}) is not one of its parts here")
        return v

    def numel(self) -> int:
        return sum(v.numel() for v in self._parts.values())


Flat = torch.Tensor | SegmentParts
"""A gradient as a push stream keeps it until its shards answer: flat in its push dtype (uncast for the names
written ahead with a cast), or the values its segments hold."""


class SliceRun(NamedTuple):
    """One run of a tensor-parallel rank's slice in one of a shard's parts (``push_slices``): the part
    (``name``, ``part``: its first element in the whole tensor), the run's first element in the slice and its
    length, the slice's flat values (contiguous, in ``dtype``, the tensor's push dtype) and its shape."""

    name: str
    part: int
    at: int
    n: int
    flat: torch.Tensor
    dtype: int
    shape: Sequence[int]


def slice_places(runs: Sequence[SliceRun], offsets: Mapping[tuple[str, int], int]) -> list[int]:
    """Where each run's bytes lie in the shard's push buffer or segment (``offsets``: each part's place, as
    ``ShmLink`` lays them out): one after another in its part's place, which holds them all (a slice has no
    more of a part's elements than the part, in the same dtype)."""
    used: dict[tuple[str, int], int] = {}
    out = []
    for r in runs:
        key = (r.name, r.part)
        at = used.get(key, 0)
        out.append(offsets[key] + at)
        used[key] = at + r.n * codec.itemsize(r.dtype)
    return out


def slice_chunk(run: SliceRun, offset: int) -> ps_pb2.Chunk:
    """The chunk naming ``run``'s bytes at ``offset`` of the push buffer or segment (offset and shape: the
    slice's)."""
    return ps_pb2.Chunk(name=run.name, offset=run.at, dtype=run.dtype, shape=run.shape,  # type: ignore[arg-type]
                        shm_offset=offset, shm_bytes=run.n * codec.itemsize(run.dtype))


def inline_slices(frames: PushFramer, runs: Sequence[SliceRun], chunk_bytes: int) -> Iterator[bytes]:
    """``runs`` as messages that carry their bytes (one copy), the last one marked last: a sliced push meant for
    shared memory whose segments closed."""
    return frames.ending(m for r in runs
                         for m in frames.chunks(r.name, r.dtype, r.shape, r.flat, r.at, r.at + r.n, chunk_bytes))


class ClientRoute(Protocol):
    """What a path reads of its client at each call (``worker/datapath/route.py``'s ``Route`` is one)."""

    @property
    def shard_map(self) -> ShardMap | None: ...

    @property
    def layouts(self) -> Mapping[str, Layout]: ...

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk of a gRPC message, in bytes."""
        ...


class Calls(Protocol):
    """A shard's Push and Pull as frames on its data connection (worker/datapath/dataconn.py ``ConnPath``); failures
    raise ``grpc.RpcError``s, read by the transport as gRPC's own."""

    def push(self, requests: Iterator[bytes], timeout: float, *, stream: bool = False) -> ps_pb2.PushResponse: ...

    def pull(self, request: ps_pb2.PullRequest, timeout: float,
             place: Callable[[str, int, int, int], torch.Tensor | None] | None = None) -> Iterator[Any]:
        """``place(tensor, first element, wire dtype, bytes)``: where a part's bytes may land as they arrive
        (a flat tensor of exactly those bytes), None for elsewhere."""
        ...


class ShardPath(Protocol):
    """How one shard's push messages are made from gradients and a pull's answers read (module docstring).

    ``flats``: flat CPU gradients in their push dtype, but for the names in
    ``cast`` (a CPU gradient in another dtype, meant to be cast as it is
    copied into shared memory): a path that carries one of those casts it.
    """

    @property
    def shard(self) -> int: ...

    @property
    def calls(self) -> Calls | None:
        """Who makes this shard's Push and Pull calls: its data connection (None: not made yet)."""
        ...

    @property
    def writes_ahead(self) -> bool:
        """Whether a push's bytes are written where the shard reads them before its messages go (``stage``),
        cast to the push dtype as they are copied: a CPU gradient may then be handed in uncast."""
        ...

    @property
    def push_segment(self) -> str:
        """The push segment a streamed push's messages name."""
        ...

    def take_pull(self, nbytes: int) -> str:
        """The segment one PullRequest asks the shard to write into (room for ``nbytes``: what the Pull may
        bring), that Pull's alone until ``pulled`` or ``unpulled`` names it (the frame's own for a ``ConnPath``,
        read as its answer comes)."""
        ...

    def stage(self, flats: Mapping[str, torch.Tensor], parts: Sequence[tuple[str, int, int]] | None = None
              ) -> Staged | None:
        """Write the shard's ``parts`` of ``flats`` (default: all of its parts) ahead, cast as they are copied;
        None when nothing was (no segments, or they closed meanwhile)."""
        ...

    def read_values(self, staged: Staged | None, flats: Mapping[str, torch.Tensor], cast: set[str],
                    route: ClientRoute) -> list[torch.Tensor]:
        """The values of the ``cast`` tensors this shard will read: those ``staged``, or as the messages will
        carry them (for the inf/nan check: a cast can overflow)."""
        ...

    def push_messages(self, frames: Frames, staged: Staged | None, flats: Mapping[str, torch.Tensor],
                      cast: set[str], route: ClientRoute) -> Iterator[bytes]:
        """A plain push's messages to this shard, its last one marked last: what ``stage`` wrote (``staged``),
        or the shard's parts of ``flats`` carried in the messages when nothing was."""
        ...

    def bucket_messages(self, frames: PushFramer, batch: Sequence[tuple[str, Flat]],
                        written: Mapping[str, Mapping[int, Sequence[ps_pb2.Chunk]]],
                        ranges: Mapping[str, Sequence[tuple[int, int]]], route: ClientRoute) -> Iterator[bytes]:
        """A streamed push's messages for one batch of gradients (none marked last). ``written``: per tensor,
        the chunks each shard's segment got in ``BucketedPush.add`` (their flats in ``batch`` are uncast);
        ``ranges``: this shard's (start, stop) of each tensor."""
        ...

    def slice_messages(self, frames: Frames, runs: Sequence[SliceRun], chunk_bytes: int) -> Iterator[bytes]:
        """A sliced push's messages to this shard (``push_slices``), its last one marked last: each run's bytes
        where this path puts a push's (in the part's place: ``slice_places``), the chunks saying where."""
        ...

    def read(self, chunk: ps_pb2.Chunk, segment: str) -> torch.Tensor:
        """A PullResponse's chunk as flat values (a view of the message or of ``segment``, the Pull's
        ``take_pull``: no copy)."""
        ...

    def pulled(self, segment: str) -> None:
        """A Pull's answers are all read (``read``): its segment is free for the next Pull, its pages past what
        a pull needs given back (``ShmLink.give_pull``)."""
        ...

    def unpulled(self, segment: str) -> None:
        """A Pull was given up before its answers were read (the shard may still write them): its segment is
        never used again (``ShmLink.drop_pull``)."""
        ...

    def close(self) -> None:
        """Release what the path holds (its segments); the shard's next calls take another path."""
        ...


def cast_values(shard: int, flats: Mapping[str, torch.Tensor], cast: set[str], route: ClientRoute
                ) -> list[torch.Tensor]:
    """Shard ``shard``'s parts of the ``cast`` tensors of ``flats``, cast to their push dtype as the frame will
    carry them (for the inf/nan check: a cast can overflow)."""
    assert route.shard_map is not None
    return [flats[p.name][p.start : p.stop].to(codec.to_torch_dtype(route.layouts[p.name].push_dtype))
            for p in route.shard_map.parts_for(shard) if p.name in cast]


def inline_messages(shard: int, frames: PushFramer, flats: Mapping[str, torch.Tensor], cast: set[str],
                    route: ClientRoute) -> Iterator[bytes]:
    """Shard ``shard``'s parts of ``flats`` as messages that carry their bytes (``PushFramer.chunks``: one copy),
    the ``cast`` ones cast to their push dtype first: a push meant for shared memory whose segments closed."""
    assert route.shard_map is not None
    for p in route.shard_map.parts_for(shard):
        flat = flats.get(p.name)
        if flat is None:
            continue
        lay = route.layouts[p.name]
        if p.name in cast:
            flat = flat.to(codec.to_torch_dtype(lay.push_dtype))
        yield from frames.chunks(p.name, lay.push_dtype, lay.shape, flat, p.start, p.stop, route.chunk_bytes)


class Pending:
    """A shard whose data connection is not made yet (before Register; after a fail-over or a lost
    connection, until it is made again): its calls wait for one (``ShardPaths.ready``), nothing is
    written ahead."""

    writes_ahead = False
    push_segment = ""
    calls = None

    def __init__(self, shard: int) -> None:
        self.shard = shard

    def stage(self, flats: Mapping[str, torch.Tensor], parts: Sequence[tuple[str, int, int]] | None = None
              ) -> Staged | None:
        return None

    def read_values(self, staged: Staged | None, flats: Mapping[str, torch.Tensor], cast: set[str],
                    route: ClientRoute) -> list[torch.Tensor]:
        return cast_values(self.shard, flats, cast, route)

    def push_messages(self, frames: Frames, staged: Staged | None, flats: Mapping[str, torch.Tensor],
                      cast: set[str], route: ClientRoute) -> Iterator[bytes]:
        raise self.unconnected()

    def bucket_messages(self, frames: PushFramer, batch: Sequence[tuple[str, Flat]],
                        written: Mapping[str, Mapping[int, Sequence[ps_pb2.Chunk]]],
                        ranges: Mapping[str, Sequence[tuple[int, int]]], route: ClientRoute) -> Iterator[bytes]:
        raise self.unconnected()

    def slice_messages(self, frames: Frames, runs: Sequence[SliceRun], chunk_bytes: int) -> Iterator[bytes]:
        raise self.unconnected()

    def read(self, chunk: ps_pb2.Chunk, segment: str) -> torch.Tensor:
        raise self.unconnected()

    def take_pull(self, nbytes: int) -> str:
        return ""

    def pulled(self, segment: str) -> None:
        pass

    def unpulled(self, segment: str) -> None:
        pass

    def unconnected(self) -> StatusError:
        return StatusError(grpc.StatusCode.UNAVAILABLE, f"shard {self.shard}: no data connection yet: asked again "
                                                        "once it is made")

    def close(self) -> None:
        pass


class ShmPath:
    """The bytes in the shard's segments (``link``), the messages saying where: what a shard on this machine's
    path (worker/datapath/dataconn.py ``ShmConnPath``, its calls as frames) does with them."""

    writes_ahead = True

    def __init__(self, link: ShmLink, shard: int) -> None:
        self.link = link
        self.shard = shard

    @property
    def push_segment(self) -> str:
        return self.link.push.name

    def take_pull(self, nbytes: int) -> str:
        try:
            return self.link.take_pull(nbytes)
        except SegmentClosed:  # a fail-over closed them meanwhile: asked again on the shard's new path
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"shard {self.shard}: its shared-memory segments "
                                                           "were closed (a fail-over): asked again") from None
        except OSError as e:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"shard {self.shard}: no room in /dev/shm for another pull segment ({e}); "
                              "fewer pulls at once (Stream(prefetch=)), or SHARDPS_SHM=0") from None

    def stage(self, flats: Mapping[str, torch.Tensor], parts: Sequence[tuple[str, int, int]] | None = None
              ) -> Staged | None:
        try:
            return self.link.write(flats, parts)
        except SegmentClosed:  # the shard failed over meanwhile: the call is made again on its new path
            return None

    def read_values(self, staged: Staged | None, flats: Mapping[str, torch.Tensor], cast: set[str],
                    route: ClientRoute) -> list[torch.Tensor]:
        if staged is None:
            return cast_values(self.shard, flats, cast, route)
        return [v for c, v in staged if c.name in cast]

    def push_messages(self, frames: Frames, staged: Staged | None, flats: Mapping[str, torch.Tensor],
                      cast: set[str], route: ClientRoute) -> Iterator[bytes]:
        if staged is None:  # written ahead on another path (a lost connection made again): written here now
            assert route.shard_map is not None
            staged = self.stage(flats, [(p.name, p.start, p.stop) for p in route.shard_map.parts_for(self.shard)
                                        if p.name in flats])
        if staged is None:  # the segments closed (a fail-over in another thread): the bytes in the messages
            framer = frames("")
            return framer.ending(inline_messages(self.shard, framer, flats, cast, route))
        return frames(self.link.push.name).shm_chunks([c for c, _ in staged], last=True)

    def bucket_messages(self, frames: PushFramer, batch: Sequence[tuple[str, Flat]],
                        written: Mapping[str, Mapping[int, Sequence[ps_pb2.Chunk]]],
                        ranges: Mapping[str, Sequence[tuple[int, int]]], route: ClientRoute) -> Iterator[bytes]:
        chunks = [c for name, _ in batch if name in written for c in written[name].get(self.shard, ())]
        if chunks:  # cast into the segment in add()
            yield from frames.shm_chunks(chunks, last=False)
        flats = {name: flat for name, flat in batch  # (a name written ahead is not copied again: its chunks)
                 if name in ranges and name not in written and isinstance(flat, torch.Tensor)}
        if flats:  # copied into it here
            staged = self.link.write(flats, [(n, a, b) for n in flats for a, b in ranges[n]])
            yield from frames.shm_chunks([c for c, _ in staged], last=False)

    def slice_messages(self, frames: Frames, runs: Sequence[SliceRun], chunk_bytes: int) -> Iterator[bytes]:
        chunks = []
        try:
            for r, off in zip(runs, slice_places(runs, self.link.offsets), strict=True):
                c = slice_chunk(r, off)
                if c.shm_bytes:
                    dst = torch.frombuffer(self.link.push.view(off, c.shm_bytes), dtype=r.flat.dtype)
                    dst.copy_(r.flat[r.at : r.at + r.n])
                chunks.append(c)
        except SegmentClosed:  # the shard failed over meanwhile: the bytes in the messages
            return inline_slices(frames(""), runs, chunk_bytes)
        return frames(self.link.push.name).shm_chunks(chunks, last=True)

    def read(self, chunk: ps_pb2.Chunk, segment: str) -> torch.Tensor:
        if chunk.shm_bytes:  # the bytes are in the Pull's segment
            return codec.decode(self.link.read(segment, chunk.shm_offset, chunk.shm_bytes), chunk.dtype)
        return codec.decode(chunk.data, chunk.dtype)

    def pulled(self, segment: str) -> None:
        self.link.give_pull(segment)

    def unpulled(self, segment: str) -> None:
        self.link.drop_pull(segment)

    def close(self) -> None:
        self.link.close()
