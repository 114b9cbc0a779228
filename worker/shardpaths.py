"""Each shard's data path, chosen once per shard (``ShardPaths``): shared memory, a data connection or gRPC.

The paths themselves are in worker/paths.py (``GrpcPath``, ``ShmPath``) and
worker/dataconn.py (``ConnPath``, on one ``DataConn`` per server process);
this module is the one place the choice is made, and undone when a shard
fails over or a connection ends. Thread-safety as worker/paths.py says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker import dataconn
from shardps.worker.layout import Layout
from shardps.worker.paths import GrpcPath, ShardPath, ShmPath
from shardps.worker.shm import ShmLink

if TYPE_CHECKING:
    from shardps.worker.transport import Transport

log = logging.getLogger("shardps.worker")


class ShardPaths(Sequence[ShardPath]):
    """Each shard's path, in shard order: gRPC until ``open`` finds a shard on this machine (module docstring).

    Read by the data path (``paths[shard]``, ``list(paths)``); changed only by
    ``open`` (the thread that drives the client), ``off`` and ``close``.
    """

    def __init__(self, worker_id: int, num_shards: int) -> None:
        self._worker_id = worker_id
        self._grpc = [GrpcPath(i) for i in range(num_shards)]
        self._paths: list[ShardPath] = list(self._grpc)
        self._conns: dict[tuple[str, int], dataconn.DataConn] = {}  # (host, data port) -> the connection

    @overload
    def __getitem__(self, shard: int) -> ShardPath: ...

    @overload
    def __getitem__(self, shard: slice) -> Sequence[ShardPath]: ...

    def __getitem__(self, shard: int | slice) -> ShardPath | Sequence[ShardPath]:
        return self._paths[shard]

    def __len__(self) -> int:
        return len(self._paths)

    def __iter__(self) -> Iterator[ShardPath]:
        return iter(self._paths)

    def open(self, smap: ShardMap, layouts: dict[str, Layout], readable: Sequence[bool],
             answers: Sequence[ps_pb2.RegisterResponse] = (), transport: Transport | None = None) -> None:
        """After Register: shared memory for every shard that read the probe (``readable``) and whose segments
        can be made (``ShmLink.open`` logs why not); else, given the shards' ``answers`` and the
        ``transport``, a data connection (worker/dataconn.py) to the process of each that gave a data
        port, one per process, unless ``SHARDPS_TCP`` is 0 or the transport has TLS; gRPC for the others."""
        tcp = transport is not None and dataconn.wanted(transport.security)
        self.close()
        for i in range(len(self._paths)):
            if readable[i]:
                link = ShmLink.open(self._worker_id, i, smap, layouts)
                if link is not None:
                    self._paths[i] = ShmPath(link, self._grpc[i])
            elif tcp and answers and answers[i].data_port:
                assert transport is not None
                conn = self._conn(transport.addresses[i].rsplit(":", 1)[0], answers[i], transport)
                if conn is not None:
                    self._paths[i] = dataconn.ConnPath(conn, answers[i].data_route, self._grpc[i], smap, layouts)

    def _conn(self, host: str, answer: ps_pb2.RegisterResponse, transport: Transport) -> dataconn.DataConn | None:
        """This worker's connection to the process at ``host`` whose data port ``answer`` gave (made once)."""
        key = (host, answer.data_port)
        conn = self._conns.get(key)
        if conn is None or conn.error:
            conn = dataconn.DataConn.open(host, answer.data_port, answer.data_token, self._worker_id,
                                          transport.timeout, lambda why: self._ended(key, why), transport.security)
            if conn is None:
                return None
            self._conns[key] = conn
        return conn

    def _ended(self, key: tuple[str, int], why: str) -> None:
        """The connection to ``key`` ended by itself: its shards take gRPC from now on."""
        quiet = why.startswith("connection closed")  # the process closed it (a stop)
        log.log(logging.INFO if quiet else logging.WARNING,
                "data connection to %s:%d ended (%s): its shards' bytes go through gRPC", *key, why)
        conn = self._conns.get(key)
        for i, p in enumerate(self._paths):
            if isinstance(p, dataconn.ConnPath) and p.conn is conn:
                self.off(i)

    def off(self, shard: int) -> None:
        """Shard ``shard`` no longer shares this machine (it failed over to its backup): gRPC from now on, its
        segments closed (a push writing them meanwhile sends its share over gRPC)."""
        path, self._paths[shard] = self._paths[shard], self._grpc[shard]
        path.close()

    def close(self) -> None:
        """Every shard back to gRPC, every segment and data connection closed (the client closes). Idempotent."""
        for i in range(len(self._paths)):
            self.off(i)
        conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()

    @property
    def links(self) -> list[ShmLink | None]:
        """Each shard's shared-memory link, None for gRPC (a snapshot, for tests and diagnostics)."""
        return [p.link if isinstance(p, ShmPath) else None for p in self._paths]
