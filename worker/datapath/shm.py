"""The worker's side of the same-host fast path (protos/shm.py): a push and a pull segment per shard.

Made after Register for every shard that read the worker's probe (it
shares this machine). ``write_push`` copies a gradient's part into the
push segment, cast to its push dtype as it copies, and gives the control message that
replaces the chunk; the shard reads it from there. The pull segment is
the shard's to write during a Pull (one part after another: offsets come
back in the answer's chunks). A shard's segments are rewritten only by the
next push or pull of this client, after the previous one has ended.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from shardps.protos import codec, shm
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
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
    """One shard's segments and where each of its parts lies in the push segment (``part_places``)."""

    def __init__(self, worker_id: int, shard: int, smap: ShardMap, layouts: dict[str, Layout]) -> None:
        self.shard = shard
        self.parts = [(p.name, p.start, p.stop) for p in smap.parts_for(shard)]  # the shard's, in shard-map order
        self._layouts = layouts
        self.offsets, at, pull_bytes = part_places(shard, smap, layouts)
        self.pull_keep: int | None = None  # see settle_pull
        self._pulled_to = 0  # the end of the furthest pull bytes read since the last settle_pull
        self.push = shm.create(f"w{worker_id}-s{shard}-push", at)
        try:
            self.pull = shm.create(f"w{worker_id}-s{shard}-pull", pull_bytes)
        except BaseException:
            self.push.close()
            raise

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

    def read(self, offset: int, nbytes: int) -> memoryview:
        view = self.pull.view(offset, nbytes)
        self._pulled_to = max(self._pulled_to, offset + nbytes)
        return view

    def settle_pull(self) -> int:
        """A pull's answers are read (nothing writes the pull segment until the next pull): its pages past the
        first ``pull_keep`` bytes given back (``Segment.release``), so that what stays in memory is what a pull
        in flight needs, not the model's share (a streamed worker's first, whole pull; None: keep every page,
        the default: they are written again each step). The bytes given back."""
        keep, end = self.pull_keep, self._pulled_to
        if keep is None or end <= keep:
            return 0
        self._pulled_to = keep
        try:
            return self.pull.release(keep, end - keep)
        except (ValueError, OSError) as e:  # closed meanwhile (a fail-over), or no MADV_REMOVE here: kept
            log.debug("shard %d: pull segment pages past %d kept: %s", self.shard, keep, e)
            return 0

    def close(self) -> None:
        self.push.close()
        self.pull.close()
