"""Each shard's data path (``ShardPaths``): its calls as frames on this worker's data connection to its process.

The paths themselves are in worker/datapath/paths.py (``Pending``, ``ShmPath``) and
worker/datapath/dataconn.py (``ConnPath`` and ``ShmConnPath``, on one ``DataConn`` per server process);
this module is the one place they are made, and made again when a shard
fails over or a connection ends. Every Push and Pull goes on a connection:
there is no other way for them.

A call takes its shard's path as it starts (``ready``): where the shard's
connection is lost, it waits for an attempt to make it again, within its
deadline; a failed attempt is UNAVAILABLE at once, as a call to an
unreachable server is (the transport retries the call, with its own
back-off, and fails the shard over to its backup where it has one).

A connection that ended by itself (the link dropped, a broken frame, the
process went) is made again in a thread of its own (``revive``: started at
once, then after 1, 2, 4 ... up to 60 seconds while it fails, or as soon
as a call waits for it). Each of its
shards is asked first where its connection goes now (``Workers.Connect``
over gRPC: a process that restarted has a new data port and token), and
the connection is made there. A shard that failed over to its backup takes
the backup process's data connection, which the backup offers in its answer
to TakeOver (``moved``: made the same way if this worker has none to that
process yet). Thread-safety as worker/datapath/paths.py says; a made-again
shard's path is set under the transport's fail-over lock, so that a
fail-over in between wins.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

import grpc

from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath import dataconn
from shardps.worker.datapath.paths import Pending, ShardPath
from shardps.worker.datapath.reach import StatusError, status_of
from shardps.worker.datapath.shm import ShmLink
from shardps.worker.layout import Layout

if TYPE_CHECKING:
    from shardps.worker.datapath.transport import Transport

log = logging.getLogger("shardps.worker")

Key = tuple[str, int]  # (host, data port): one connection each
MAX_BACKOFF_S = 60.0


def _usable(path: ShardPath) -> bool:
    """Whether a call can go on ``path`` now: its connection serves."""
    conn = getattr(path, "conn", None)
    return conn is not None and not getattr(path, "closed", True) and not conn.error


class ShardPaths(Sequence[ShardPath]):
    """Each shard's path, in shard order: ``Pending`` until ``open`` (module docstring).

    Read by the data path (``ready(shard, timeout)`` as a call starts, ``paths[shard]`` to plan); changed by
    ``open`` (the thread that drives the client), ``moved``, ``off``, ``close`` and the thread that makes a
    lost connection again.
    """

    def __init__(self, worker_id: int, num_shards: int) -> None:
        self._worker_id = worker_id
        self._paths: list[ShardPath] = [Pending(i) for i in range(num_shards)]
        self._conns: dict[Key, dataconn.DataConn] = {}
        self._links: list[ShmLink | None] = [None] * num_shards  # each shard's segments, kept across connections
        self._pull_keep: int | None = None  # keep_pull's
        self._lost: dict[int, tuple[float, float]] = {}  # shard -> (next attempt, back-off s)
        self._why: dict[int, str] = {}  # shard -> why its connection is not made (for the error that waits end with)
        self._tried: dict[int, int] = {}  # shard -> attempts to make its connection ended (``ready`` waits for one)
        self._reviving: threading.Thread | None = None
        self._cv = threading.Condition()  # _lost, _why, _reviving, path changes (``ready`` waits on it)
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
             answers: Sequence[ps_pb2.RegisterResponse | ps_pb2.ConnectResponse], transport: Transport) -> None:
        """After Register (or a pull-only client's Connect: ``PSClient.attach``): per shard, shared memory where
        it read the probe (``readable``) and its segments can be made (``ShmLink.open`` logs why not), and the
        data connection its answer (``answers``) offers, one per process: ``ShmConnPath`` (the frames say where
        the bytes lie) or ``ConnPath`` (the bytes in them). A connection that cannot be made now is made again
        as a lost one is (``revive``)."""
        self.close()
        self._opened = (smap, layouts, transport)
        for i in range(len(self._paths)):
            answer = answers[i]
            if not answer.data_port:
                raise RuntimeError(f"shard {i} at {transport.addresses[i]} offered no data port: a server of "
                                   "another shardps version?")
            link = self._links[i] = ShmLink.open(self._worker_id, i, smap, layouts) if readable[i] else None
            if link is not None:
                link.pull_keep = self._pull_keep
            host = transport.addresses[i].rsplit(":", 1)[0]
            self._place(i, (host, answer.data_port), answer.data_token, answer.data_route)

    def keep_pull(self, nbytes: int | None) -> None:
        """Keep at most the first ``nbytes`` of each shard's pull segment in memory once a pull is read
        (``ShmLink.settle_pull``; None: every page, the default). A streamed worker's (worker/streaming) pulls
        are a unit's weights at a time: its segments then hold what a pull in flight needs, not its share of the
        model. For the segments made from now on too."""
        with self._cv:
            self._pull_keep = nbytes
            links = list(self._links)
        for link in links:
            if link is not None:
                link.pull_keep = nbytes

    def _place(self, shard: int, key: Key, token: bytes, route: int) -> bool:
        """Shard ``shard``'s calls on this worker's connection at ``key`` (made now if there is none); when it
        cannot be made, the shard is lost (``revive`` makes it again). Whether it is placed."""
        opened = self._opened
        if opened is None:  # closed meanwhile (a made-again connection's thread; ``close`` joins it)
            return False
        smap, layouts, transport = opened
        conn = self._conns.get(key)
        if conn is None or conn.error:
            try:
                conn = dataconn.DataConn.open(key[0], key[1], token, self._worker_id, transport.timeout,
                                              lambda why: self._ended(key, why), transport.security)
            except dataconn.ConnectFailed as e:
                log.warning("shard %d: %s: made again in the background; its calls wait for it", shard, e)
                self._lose(shard, str(e))
                return False
            old, self._conns[key] = self._conns.get(key), conn
            if old is not None:
                old.close()
        link = self._links[shard]
        new: ShardPath = (dataconn.ShmConnPath(link, shard, conn, route) if link is not None
                          else dataconn.ConnPath(conn, route, shard, smap, layouts))
        with self._cv:
            old_path, self._paths[shard] = self._paths[shard], new
            self._lost.pop(shard, None)
            self._why.pop(shard, None)
            self._cv.notify_all()
        old_path.close()  # (its segments are the new path's too: ``off`` closes them)
        if conn.error:  # ended meanwhile (its end may not have seen this shard): made again
            self._lose(shard, conn.error)
            return False
        return True

    def _place_into(self, placed: list[bool], shard: int, key: Key, answer: ps_pb2.ConnectResponse) -> None:
        placed.append(self._place(shard, key, answer.data_token, answer.data_route))

    def _lose(self, shard: int, why: str) -> None:
        """Shard ``shard``'s connection is to be made again (``revive``), its calls waiting for it."""
        with self._cv:
            if self._opened is None:
                return
            self._lost.setdefault(shard, (0.0, 1.0))
            self._why[shard] = why
        self.revive()

    def _ended(self, key: Key, why: str) -> None:
        """The connection to ``key`` ended by itself: its shards' connection is made again."""
        quiet = why.startswith("connection closed")  # the process closed it (a stop)
        log.log(logging.INFO if quiet else logging.WARNING,
                "data connection to %s:%d ended (%s): made again; its shards' calls wait for it", *key, why)
        for i, p in enumerate(self._paths):  # every shard on a connection that ended (this one, or one before)
            conn = getattr(p, "conn", None)
            if conn is not None and conn.error:
                self._lose(i, f"data connection to {conn.where} ended ({conn.error})")

    def ready(self, shard: int, timeout: float) -> ShardPath:
        """Shard ``shard``'s path for a call that starts now, once its connection serves: where it is lost, an
        attempt to make it again (``revive``: started now, whatever its back-off) is waited for, for at most
        ``timeout`` seconds. A failed attempt, or none done in time, is UNAVAILABLE saying why, at once (as
        the shard's gRPC call would have been): the transport retries the call, or fails the shard over."""
        deadline = time.monotonic() + timeout
        with self._cv:
            tried = self._tried.get(shard, 0)
            while True:
                path = self._paths[shard]
                if _usable(path):
                    return path
                if self._opened is None:
                    raise StatusError(grpc.StatusCode.UNAVAILABLE, f"shard {shard}: the client is not registered "
                                                                   "or was closed: no data connection")
                if shard not in self._lost:  # (a connection that ended but whose end was not heard yet)
                    self._lost[shard] = (0.0, 1.0)
                    self._why.setdefault(shard, "its data connection ended")
                why = self._why.get(shard, "being made")
                if self._tried.get(shard, 0) > tried:  # an attempt since the call began failed
                    raise StatusError(grpc.StatusCode.UNAVAILABLE, f"shard {shard}: no data connection ({why})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                      f"shard {shard}: no data connection within {timeout:g}s ({why})")
                if self._reviving is None or not self._reviving.is_alive():
                    self._cv.release()
                    try:
                        self.revive(now=True)
                    finally:
                        self._cv.acquire()
                    continue
                self._cv.wait(left)

    def usable(self, shard: int) -> bool:
        """Whether ``shard``'s calls can go now without waiting (its connection serves)."""
        return _usable(self._paths[shard])

    def revive(self, *, now: bool = False) -> threading.Thread | None:
        """Start making lost connections again, where one is due (``now``: every lost one, a call waits for it;
        module docstring): the thread doing it (the caller need not wait for it), or None."""
        with self._cv:
            if not self._lost or self._opened is None or (self._reviving is not None and self._reviving.is_alive()):
                return None
            at = time.monotonic()
            due = sorted(i for i, (when, _) in self._lost.items() if now or when <= at)
            if not due:
                return None
            t = self._reviving = threading.Thread(target=self._revive, args=(due,), daemon=True,
                                                  name=f"shardps-data-revive-w{self._worker_id}")
            t.start()  # under the lock: ``close`` and ``ready`` never find it listed and not started
        return t

    def _revive(self, shards: list[int]) -> None:
        try:
            self._revive_each(shards)
        finally:
            with self._cv:
                self._cv.notify_all()  # waiters look at what changed, and start the next attempt when due

    def _revive_each(self, shards: list[int]) -> None:
        opened = self._opened
        if opened is None:
            return
        _, _, transport = opened
        for shard in shards:
            address = transport.addresses[shard]
            try:
                answer = transport.stub(shard).Connect(ps_pb2.ConnectRequest(worker_id=self._worker_id),
                                                       timeout=min(10.0, transport.timeout))
            except ValueError:  # the client closes: its channels are closed (``close`` joins this thread next)
                return
            except grpc.RpcError as e:
                code, details = status_of(e)
                self._failed(shard, f"Connect at {address}: {code.name}: {details}")
                continue
            key = (address.rsplit(":", 1)[0], answer.data_port)
            placed: list[bool] = []
            if not transport.at(shard, address, functools.partial(self._place_into, placed, shard, key, answer)):
                self._done(shard)  # failed over meanwhile: ``moved`` placed it
                continue
            if placed[0]:
                log.info("shard %d: data connection to %s:%d made again", shard, *key)
                self._done(shard)
            else:
                self._failed(shard, self._why.get(shard, "the connection could not be made"))

    def _done(self, shard: int) -> None:
        """An attempt for shard ``shard`` ended (``ready`` waits for one)."""
        with self._cv:
            self._tried[shard] = self._tried.get(shard, 0) + 1
            self._cv.notify_all()

    def _failed(self, shard: int, why: str) -> None:
        """An attempt to make shard ``shard``'s connection failed: the next one after a longer back-off."""
        with self._cv:
            backoff = self._lost.get(shard, (0.0, 0.0))[1]
            if shard in self._lost:
                self._lost[shard] = (time.monotonic() + backoff, min(MAX_BACKOFF_S, 2 * backoff))
                self._why[shard] = why
        self._done(shard)  # after the why: the call that waited for it says it
        log.warning("shard %d: %s; tried again in %.0fs", shard, why, backoff)

    def moved(self, shard: int, answer: ps_pb2.PromoteResponse) -> None:
        """Shard ``shard`` failed over (``Transport.on_moved``, under its fail-over lock; the transport already
        talks to the new primary): its segments and place on a connection closed, and its calls frames on
        this worker's connection to the new primary's process, at the data port ``answer`` gives (the
        connection made now if there is none yet; where that fails, made again as a lost one is)."""
        self.off(shard)
        if self._opened is None:
            return
        if not answer.data_port:
            self._lose(shard, f"the new primary at {self._opened[2].addresses[shard]} offered no data port")
            return
        host = self._opened[2].addresses[shard].rsplit(":", 1)[0]
        self._place(shard, (host, answer.data_port), answer.data_token, answer.data_route)

    def off(self, shard: int) -> None:
        """Shard ``shard`` without a path from now on (the client closes, or ``moved`` begins): its segments
        and its place on a connection closed (a push writing its segments meanwhile is made again)."""
        with self._cv:
            path, self._paths[shard] = self._paths[shard], Pending(shard)
            link, self._links[shard] = self._links[shard], None
            self._lost.pop(shard, None)
            self._why.pop(shard, None)
        path.close()
        if link is not None:
            link.close()

    def close(self) -> None:
        """Every shard without a path, every segment and data connection closed (the client closes, or
        registers again). Idempotent."""
        with self._cv:
            self._opened = None
            self._lost.clear()
            reviving, self._reviving = self._reviving, None
            self._cv.notify_all()
        if reviving is not None:
            reviving.join()
        for i in range(len(self._paths)):
            self.off(i)
        conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()

    @property
    def links(self) -> list[ShmLink | None]:
        """Each shard's shared-memory link while its calls use it, None otherwise (a snapshot, for tests and
        diagnostics)."""
        return [getattr(p, "link", None) if _usable(p) else None for p in self._paths]
