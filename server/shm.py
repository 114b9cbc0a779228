"""The shard's side of the same-host fast path: the workers' shared-memory segments, mapped on first use.

``SegmentCache.view(worker, name, offset, nbytes)`` maps segment ``name``
(protos/shm.py) once and returns a bounds-checked view of it; a bad name,
a missing segment or bytes outside it are INVALID_ARGUMENT naming the
segment. A worker's mappings are dropped when it leaves; at most ``limit``
stay mapped (the least recently used go first). Names ``tcp-<seq>`` are the
TCP bulk path's remote segments (server/tcpdata.py): handed to ``remote``
when the shard has a data port, refused when it has none.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from shardps.protos import shm, tcpdata
from shardps.server.errors import InvalidArgument

if TYPE_CHECKING:
    from shardps.server.tcpdata import TcpData


class SegmentCache:
    def __init__(self, limit: int = 256) -> None:
        self._lock = threading.Lock()
        self._segments: OrderedDict[str, tuple[shm.Segment, int]] = OrderedDict()
        self.limit = limit
        self.remote: TcpData | None = None  # the TCP bulk path's data port (create_server), if any

    def _remote(self, name: str) -> TcpData:
        if self.remote is None:
            raise InvalidArgument(f"data segment {name[:80]!r}: this server has no data port (TCP path off)")
        return self.remote

    def get(self, worker_id: int, name: str) -> shm.Segment:
        if name.startswith(tcpdata.PREFIX):
            return self._remote(name).pull_segment(worker_id, name)
        with self._lock:
            hit = self._segments.get(name)
            if hit is not None:
                self._segments.move_to_end(name)
                return hit[0]
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
        """``tensor``: whose bytes these are (named in the TCP path's errors)."""
        if name.startswith(tcpdata.PREFIX):
            return self._remote(name).view(worker_id, name, offset, nbytes, tensor)
        try:
            return self.get(worker_id, name).view(offset, nbytes)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None

    def forget(self, worker_id: int) -> None:
        """Unmap the segments of a worker that left (and close its data connection)."""
        if self.remote is not None:
            self.remote.forget(worker_id)
        with self._lock:
            names = [n for n, (_, w) in self._segments.items() if w == worker_id]
            for n in names:
                self._segments.pop(n)[0].close()

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        with self._lock:
            for seg, _ in self._segments.values():
                seg.close()
            self._segments.clear()
