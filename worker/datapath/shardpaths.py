"""Each shard's data path, chosen once per shard (``ShardPaths``): shared memory, a data connection or gRPC.

The paths themselves are in worker/datapath/paths.py (``GrpcPath``, ``ShmPath``) and
worker/datapath/dataconn.py (``ConnPath`` and ``ShmConnPath``, on one ``DataConn`` per server process);
this module is the one place the choice is made, and undone when a shard
fails over or a connection ends.

A connection that ended by itself (the link dropped, a broken frame) is
made again: ``revive``, called as each push begins, starts one attempt in a
thread of its own (the step never waits on a connect) as soon as the
connection is lost, then after 1, 2, 4 ... up to 60 seconds while it fails
(the process restarted: its port and token are gone until the worker
registers again, which opens every connection anew). Meanwhile the shards'
calls go through gRPC (a shard with shared memory keeps its segments:
``ShmPath``, its calls over gRPC, until ``ShmConnPath`` again). A shard that failed over to its backup takes the
backup process's data connection, which the backup offers in its answer to
TakeOver (``moved``: made the same way if this worker has none to that
process yet); gRPC where it offers none. Thread-safety as
worker/datapath/paths.py says; a revived shard's path is set under the
transport's fail-over lock, so that a fail-over in between wins.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath import dataconn
from shardps.worker.datapath.paths import GrpcPath, ShardPath, ShmPath
from shardps.worker.datapath.shm import ShmLink
from shardps.worker.layout import Layout

if TYPE_CHECKING:
    from shardps.worker.datapath.transport import Transport

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
        # Each shard on a data connection: its connection's key, token, route, and the address it was
        # registered at (a revived connection serves it only while the transport still talks there).
        self._offers: dict[int, tuple[tuple[str, int], bytes, int, str]] = {}
        self._lost: dict[tuple[str, int], tuple[float, float]] = {}  # key -> (next attempt, back-off s)
        self._reviving: threading.Thread | None = None
        self._mu = threading.Lock()  # _lost, _reviving
        self._opened: tuple[ShardMap, dict[str, Layout], Transport] | None = None

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
        can be made (``ShmLink.open`` logs why not); given the shards' ``answers`` and the ``transport``, a
        data connection (worker/datapath/dataconn.py) to the process of each that gave a data port, one per
        process, unless ``SHARDPS_TCP`` is 0: its calls as frames there (with shared memory: ``ShmConnPath``,
        the frames saying where the bytes lie; without: ``ConnPath``, the bytes in them); gRPC for the
        others."""
        tcp = transport is not None and dataconn.wanted(transport.security)
        self.close()
        self._opened = (smap, layouts, transport) if transport is not None else None
        for i in range(len(self._paths)):
            link = ShmLink.open(self._worker_id, i, smap, layouts) if readable[i] else None  # None: it said why
            if tcp and answers and answers[i].data_port:
                assert transport is not None
                host = transport.addresses[i].rsplit(":", 1)[0]
                conn = self._conn(host, answers[i], transport)
                if conn is not None:
                    self._paths[i] = (dataconn.ShmConnPath(link, self._grpc[i], conn, answers[i].data_route)
                                      if link is not None else
                                      dataconn.ConnPath(conn, answers[i].data_route, self._grpc[i], smap, layouts))
                    self._offers[i] = ((host, answers[i].data_port), answers[i].data_token, answers[i].data_route,
                                       transport.addresses[i])
                    continue
            if link is not None:
                self._paths[i] = ShmPath(link, self._grpc[i])

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
                "data connection to %s:%d ended (%s): its shards' calls go through gRPC", *key, why)
        conn = self._conns.get(key)
        for i, p in enumerate(self._paths):
            if isinstance(p, dataconn.ConnPath) and p.conn is conn:
                self._paths[i] = self._grpc[i]
                p.close()
            elif isinstance(p, dataconn.ShmConnPath) and p.conn is conn:  # the segments stay; control by gRPC
                self._paths[i] = ShmPath(p.link, self._grpc[i])
                p.detach()
        with self._mu:
            if key in self._conns:  # not closed meanwhile: made again (``revive``)
                self._lost.setdefault(key, (0.0, 1.0))

    def revive(self) -> threading.Thread | None:
        """Start making a lost connection again, if one is due (module docstring): the thread doing it (the
        caller need not wait for it), or None."""
        with self._mu:
            if not self._lost or (self._reviving is not None and self._reviving.is_alive()):
                return None
            now = time.monotonic()
            due = [k for k, (when, _) in self._lost.items() if when <= now]
            if not due or self._opened is None:
                return None
            t = self._reviving = threading.Thread(target=self._revive, args=(due,), daemon=True,
                                                  name=f"shardps-data-revive-w{self._worker_id}")
        t.start()
        return t

    def _revive(self, keys: list[tuple[str, int]]) -> None:
        assert self._opened is not None
        smap, layouts, transport = self._opened
        for key in keys:
            offers = dict(self._offers)  # as it is now (``moved`` and ``off`` may change it meanwhile)
            shards = [i for i, o in offers.items() if o[0] == key]
            if not shards:  # every shard of it moved elsewhere (a fail-over): nothing to make again
                with self._mu:
                    self._lost.pop(key, None)
                continue
            _, token, _, _ = offers[shards[0]]
            conn = dataconn.DataConn.open(key[0], key[1], token, self._worker_id, transport.timeout,
                                          functools.partial(self._ended, key), transport.security)
            with self._mu:
                if key not in self._lost:  # closed meanwhile (the client closes, or registers again)
                    if conn is not None:
                        conn.close()
                    continue
                if conn is None:
                    _, backoff = self._lost[key]
                    self._lost[key] = (time.monotonic() + backoff, min(60.0, 2 * backoff))
                    continue
                del self._lost[key]
                old, self._conns[key] = self._conns.get(key), conn
            if old is not None:
                old.close()
            back = [i for i in shards if transport.at(i, offers[i][3], functools.partial(
                self._restore, i, conn, offers[i][2], smap, layouts))]
            log.info("data connection to %s:%d made again: shards %s take it", *key, back)

    def _restore(self, shard: int, conn: dataconn.DataConn, route: int, smap: ShardMap,
                 layouts: dict[str, Layout]) -> None:
        """Shard ``shard``'s calls on ``conn`` again, unless that connection ended meanwhile. Its end (``_ended``)
        puts back every path on it that it finds, and marks it lost; a path put on it after its end looked is
        taken back here (the connection says it ended before it looks: a path put first is found there)."""
        path = self._paths[shard]
        new: dataconn.ConnPath | dataconn.ShmConnPath
        if isinstance(path, GrpcPath):
            new = dataconn.ConnPath(conn, route, self._grpc[shard], smap, layouts)
        elif type(path) is ShmPath:  # its segments, its calls on the connection again
            new = dataconn.ShmConnPath(path.link, self._grpc[shard], conn, route)
        else:
            return
        self._paths[shard] = new
        if conn.error and self._paths[shard] is new:  # ended meanwhile: the shard stays where it was
            self._paths[shard] = path
            if isinstance(new, dataconn.ShmConnPath):
                new.detach()  # (its segments are the plain path's)
            else:
                new.close()

    def moved(self, shard: int, answer: ps_pb2.PromoteResponse) -> None:
        """Shard ``shard`` failed over (``Transport.on_moved``, under its fail-over lock; the transport already
        talks to the new primary): its segments or connection closed, and, where the new primary's process
        gave a data port in ``answer``, its calls are frames there, on this worker's connection to that
        process (made in a thread of its own if there is none yet, as a lost one is: ``revive``; gRPC
        meanwhile); else gRPC."""
        self.off(shard)
        if not answer.data_port or self._opened is None:
            return
        smap, layouts, transport = self._opened
        address = transport.addresses[shard]
        key = (address.rsplit(":", 1)[0], answer.data_port)
        self._offers[shard] = (key, answer.data_token, answer.data_route, address)
        conn = self._conns.get(key)
        if conn is not None and not conn.error:
            self._restore(shard, conn, answer.data_route, smap, layouts)
            return
        with self._mu:
            self._lost.setdefault(key, (0.0, 1.0))  # made at the next push (``revive``)

    def off(self, shard: int) -> None:
        """Shard ``shard`` on gRPC from now on (the client closes, or ``moved`` begins), its segments or its
        place on a connection closed (a push writing its segments meanwhile sends its share over gRPC)."""
        self._offers.pop(shard, None)
        path, self._paths[shard] = self._paths[shard], self._grpc[shard]
        path.close()

    def close(self) -> None:
        """Every shard back to gRPC, every segment and data connection closed (the client closes). Idempotent."""
        with self._mu:
            self._lost.clear()
            reviving, self._reviving = self._reviving, None
        if reviving is not None:
            reviving.join()
        for i in range(len(self._paths)):
            self.off(i)
        with self._mu:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()

    @property
    def links(self) -> list[ShmLink | None]:
        """Each shard's shared-memory link, None for gRPC (a snapshot, for tests and diagnostics)."""
        return [p.link if isinstance(p, ShmPath) else None for p in self._paths]
