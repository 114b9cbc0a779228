"""The worker's side of the same-host fast path (protos/shm.py): per shard a push segment, a pull segment per Pull.

Made after Register for every shard that read the worker's probe (it
shares this machine). ``write_push`` copies a gradient's part into the
push segment, cast to its push dtype as it copies, and gives the control message that
replaces the chunk; the shard reads it from there. The push segment is
rewritten only by the next push of this client, after the previous one has
ended. A pull segment is the shard's to write during one Pull (one part
after another from offset 0: offsets come back in the answer's chunks), and
each Pull in flight has one of its own (``take_pull``): a streamed worker
prefetching asks a shard for several units at once, and the shard writes
each answer as soon as it can, before the worker has read the one before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import torch

from shardps.protos import codec, shm
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.shm import SegmentClosed
from shardps.worker.layout import Layout

log = logging.getLogger("shardps.worker")


def shm_probe(worker_id: int) -> tuple[shm.Segment, bytes] | None:
    """A probe segment and its token for Register (a shard on this machine reads it back), after removing
    the segments of dead workers; None when this machine has no shared memory (the calls carry the bytes)."""
    try:
        gone = shm.remove_stale()
        if gone:
            log.info("worker %d: removed %d shared-memory segments of dead workers", worker_id, len(gone))
        return shm.probe()
    except OSError as e:
        log.warning("worker %d: no shared memory here (%s): tensor bytes go in the data connection's "
                    "frames", worker_id, e)
        return None


def part_places(shard: int, smap: ShardMap, layouts: Mapping[str, Layout]
                ) -> tuple[dict[tuple[str, int], int], int, int]:
    """Where a push puts each of ``shard``'s parts, in its push dtype, one after another on 64-byte boundaries
    in shard-map order (by (name, start)); the bytes that takes, and those a pull of every part takes (room for
    fp32, the widest dtype a pull may ask). One layout for both of a push's places: the shard's push segment
    (``ShmLink``) and the frame's push buffer (worker/datapath/dataconn.py ``ConnPath``)."""
    offsets: dict[tuple[str, int], int] = {}
    at = pull = 0
    for p in smap.parts_for(shard):
        n = p.stop - p.start
        offsets[(p.name, p.start)] = at
        at = shm.aligned(at + n * codec.itemsize(layouts[p.name].push_dtype))
        pull = shm.aligned(pull + n * 4)
    return offsets, at, pull


class ShmLink:
    """One shard's segments: a push segment, where each of its parts lies (``part_places``), and pull segments,
    one for each Pull in flight (``take_pull``; the first, ``pull``, made with the link)."""

    def __init__(self, worker_id: int, shard: int, smap: ShardMap, layouts: dict[str, Layout]) -> None:
        self.shard = shard
        self.parts = [(p.name, p.start, p.stop) for p in smap.parts_for(shard)]  # the shard's, in shard-map order
        self._layouts = layouts
        self.offsets, at, pull_bytes = part_places(shard, smap, layouts)
        self._tag = f"w{worker_id}-s{shard}"
        self.pull_keep: int | None = None  # see settle_pull
        self.push = shm.create(f"{self._tag}-push", at)
        try:
            self.pull = shm.create(f"{self._tag}-pull", pull_bytes)  # room for a pull of every part
        except BaseException:
            self.push.close()
            raise
        self._pull_mu = threading.Lock()
        self._pulls: dict[str, shm.Segment] = {self.pull.name: self.pull}  # every pull segment not given up
        self._free: list[shm.Segment] = [self.pull]  # those no Pull has now
        self._pulled_to: dict[str, int] = {}  # per segment, the end of the furthest bytes read since settled
        self._closed = False

    @staticmethod
    def open(worker_id: int, shard: int, smap: ShardMap, layouts: dict[str, Layout]) -> ShmLink | None:
        """The link to ``shard`` (which read this worker's probe), or None (logged) when its segments cannot
        be made: its bytes then go in the frames on the data connection."""
        try:
            return ShmLink(worker_id, shard, smap, layouts)
        except OSError as e:
            log.warning("worker %d: no shared memory for shard %d (%s): its bytes go in the data "
                        "connection's frames", worker_id, shard, e)
            return None

    def write_push(self, name: str, dtype: int, flat: torch.Tensor, start: int, stop: int
                   ) -> tuple[ps_pb2.Chunk, torch.Tensor]:
        """Copy ``flat[start:stop]`` into the push segment, cast to ``dtype`` as it is copied (one pass, no
        buffer in between); the chunk that says where, and the values written (a view of the segment)."""
        off = self.offsets[(name, start)]
        tdt = codec.to_torch_dtype(dtype)
        nbytes = (stop - start) * tdt.itemsize
        dst = torch.frombuffer(self.push.view(off, nbytes), dtype=tdt) if nbytes else torch.empty(0, dtype=tdt)
        dst.copy_(flat[start:stop])
        return ps_pb2.Chunk(name=name, offset=start, dtype=dtype, shm_offset=off,  # type: ignore[arg-type]
                            shm_bytes=nbytes), dst

    def write(self, flats: Mapping[str, torch.Tensor], parts: Sequence[tuple[str, int, int]] | None = None
              ) -> list[tuple[ps_pb2.Chunk, torch.Tensor]]:
        """Copy the shard's parts of ``flats`` (flat CPU tensors of any float dtype: cast to each tensor's
        push dtype as they are copied) into the push segment: per part the chunk that says where (with the
        tensor's shape) and the values written. ``parts``: (name, start, stop) of the shard's parts to
        write, if the caller knows them (default: all of the shard's). Raises ``SegmentClosed`` when the
        segment was closed meanwhile (a fail-over)."""
        out = []
        for name, start, stop in self.parts if parts is None else parts:
            flat = flats.get(name)
            if flat is not None:
                lay = self._layouts[name]
                chunk, written = self.write_push(name, lay.push_dtype, flat, start, stop)
                chunk.shape.extend(lay.shape)  # one chunk per part: each says the shape
                out.append((chunk, written))
        return out

    def take_pull(self, nbytes: int) -> str:
        """A pull segment of at least ``nbytes`` for one Pull, its own until ``give_pull`` (its answer read) or
        ``drop_pull`` (given up: the shard may still write it): the smallest free one that holds it, else a new
        one of ``nbytes``, so that the segments are sized by the pulls in flight, not the model (``OSError``
        when /dev/shm has no room, ``SegmentClosed`` once the link is closed)."""
        with self._pull_mu:
            if self._closed:  # closed meanwhile (a fail-over): no segment is made for a link gone
                raise SegmentClosed(f"shard {self.shard}: its segments were closed")
            fits = [seg for seg in self._free if seg.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda f: f.size)
                self._free.remove(seg)
                return seg.name
            seg = shm.create(f"{self._tag}-pull{len(self._pulls)}", shm.aligned(max(1, nbytes)))
            self._pulls[seg.name] = seg
            return seg.name

    def read(self, segment: str, offset: int, nbytes: int) -> memoryview:
        """Bytes a Pull's answer names in its pull segment (``take_pull``'s name)."""
        seg = self._pulls.get(segment)
        if seg is None:
            if self._closed:  # the link closed meanwhile (a fail-over): as a closed segment's view says
                raise SegmentClosed(f"shard {self.shard}: pull segment {segment!r} was closed")
            raise ValueError(f"shard {self.shard}: no pull segment {segment!r} of this worker's is in use")
        view = seg.view(offset, nbytes)
        self._pulled_to[segment] = max(self._pulled_to.get(segment, 0), offset + nbytes)
        return view

    def give_pull(self, segment: str) -> None:
        """The Pull that had ``segment`` is read: the segment is free for the next (``settle_pull`` first)."""
        self.settle_pull(segment)
        with self._pull_mu:
            seg = self._pulls.get(segment)
            if seg is not None and seg not in self._free:
                self._free.append(seg)

    def drop_pull(self, segment: str) -> None:
        """The Pull that had ``segment`` was given up before its answer was read (cancelled, timed out,
        failed): the shard may still write into it, so no other Pull gets it. Unmapped and removed here (the
        shard unmaps it before it maps another of this worker's: server/datapath/shm.py ``SegmentCache``)."""
        with self._pull_mu:
            seg = self._pulls.pop(segment, None)
            self._pulled_to.pop(segment, None)
            if seg is not None and seg in self._free:  # (given back already: no Pull has it)
                self._free.remove(seg)
        if seg is not None:
            seg.close()

    def settle_pull(self, segment: str) -> int:
        """A Pull's answers are read from ``segment``: its pages past the first ``pull_keep`` bytes given back
        (``Segment.release``), so that what stays in memory is what a pull needs, not the model's share (a
        streamed worker's first, whole pull; None: keep every page, the default: they are written again each
        step). The bytes given back."""
        if self.pull_keep is None:
            return 0
        keep = self.pull_keep + 64 * len(self.parts)  # the shard puts each part on a 64-byte boundary
        end, seg = self._pulled_to.get(segment, 0), self._pulls.get(segment)
        if end <= keep or seg is None:
            return 0
        self._pulled_to[segment] = keep
        try:
            return seg.release(keep, end - keep)
        except (ValueError, OSError) as e:  # closed meanwhile (a fail-over), or no MADV_REMOVE here: kept
            log.debug("shard %d: pull segment pages past %d kept: %s", self.shard, keep, e)
            return 0

    @property
    def pull_segments(self) -> list[shm.Segment]:
        """Every pull segment not given up (a snapshot, for tests and diagnostics)."""
        with self._pull_mu:
            return list(self._pulls.values())

    def close(self) -> None:
        self.push.close()
        with self._pull_mu:
            self._closed = True
            pulls, self._pulls, self._free = list(self._pulls.values()), {}, []
        for seg in pulls:
            seg.close()
        self.pull.close()  # (given up earlier, or among them: closing is idempotent)
