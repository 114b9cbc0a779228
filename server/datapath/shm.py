"""The shard's side of the same-host fast path: the workers' shared-memory segments, mapped on first use.

``SegmentCache.view(worker, name, offset, nbytes)`` maps segment ``name``
(protos/shm.py) once and returns a bounds-checked view of it; a bad name,
a missing segment or bytes outside it are INVALID_ARGUMENT naming the
segment. A worker's mappings are dropped when it leaves; at most ``limit``
stay mapped (the least recently used go first). ``Segments`` is what a
Push or Pull reads its chunks through: this cache, or a data connection's
frames in front of it (server/datapath/dataconn.py ``FrameSegments``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

from shardps.protos import shm
from shardps.server.errors import InvalidArgument


class Segments(Protocol):
    """Where a Push's or Pull's chunks that name a segment lie (INVALID_ARGUMENT for a bad one)."""

    def get(self, worker_id: int, name: str) -> shm.Segment: ...

    def view(self, worker_id: int, name: str, offset: int, nbytes: int, tensor: str = "") -> memoryview: ...


class SegmentCache:
    def __init__(self, limit: int = 256) -> None:
        self._lock = threading.Lock()
        self._segments: OrderedDict[str, tuple[shm.Segment, int]] = OrderedDict()
        self.limit = limit

    def get(self, worker_id: int, name: str) -> shm.Segment:
        with self._lock:
            hit = self._segments.get(name)
            if hit is not None:
                self._segments.move_to_end(name)
                return hit[0]
        self._prune(worker_id)
        try:
            seg = shm.open_segment(name)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        except OSError as e:
            raise InvalidArgument(f"shared-memory segment {name[:80]!r} cannot be opened here: {e.strerror}") from None
        with self._lock:
            old = self._segments.get(name)
            if old is not None:  # another thread mapped it meanwhile
                seg.close()
                return old[0]
            self._segments[name] = (seg, worker_id)
            while len(self._segments) > self.limit:
                _, (gone, _) = self._segments.popitem(last=False)
                gone.close()
        return seg

    def view(self, worker_id: int, name: str, offset: int, nbytes: int, tensor: str = "") -> memoryview:
        """``tensor``: whose bytes these are (named in a data connection's errors)."""
        try:
            return self.get(worker_id, name).view(offset, nbytes)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None

    def _prune(self, worker_id: int) -> None:
        """Unmap ``worker_id``'s segments whose files it removed (a pull segment it gave up, the shard may have
        written it meanwhile: the pages go with the last mapping). Run on a miss, before mapping another."""
        with self._lock:
            gone = [n for n, (_, w) in self._segments.items() if w == worker_id and not (shm.SHM_DIR / n).exists()]
            segs = [self._segments.pop(n)[0] for n in gone]
        for seg in segs:
            seg.close()

    def forget(self, worker_id: int) -> None:
        """Unmap the segments of a worker that left."""
        with self._lock:
            names = [n for n, (_, w) in self._segments.items() if w == worker_id]
            for n in names:
                self._segments.pop(n)[0].close()

    def close(self) -> None:
        with self._lock:
            for seg, _ in self._segments.values():
                seg.close()
            self._segments.clear()
