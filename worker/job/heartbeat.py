"""Heartbeats: a registered worker renews its lease on every shard in the background.

Push and Pull renew the lease too; heartbeats keep a worker that computes for
longer than its lease from being evicted. ``PSClient.register`` starts them
(every lease / 3), ``close()`` stops them; the thread checks for a stop
between shards, so stopping never waits for more than the call under way.

While a Register is under way, each shard that answered it is beaten at once
(``joined``): one shard slow to answer (a fail-over, tensors not yet created)
must not let the lease run out on those that answered fast, or the worker's
first push would meet an eviction there and lose its step.

A heartbeat's answer also names the shard's backup when one was attached
since registering (after a takeover, a spare): the transport learns it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath.transport import Transport
from shardps.worker.errors import ShardError

log = logging.getLogger("shardps.worker")


class Heartbeats:
    """The background thread renewing ``worker_id``'s lease on every shard of ``transport``."""

    def __init__(self, transport: Transport, worker_id: int) -> None:
        self.transport = transport
        self.worker_id = worker_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        self._every = 0.0
        self._leases: dict[int, float] = {}  # the shards that answered a Register under way: their lease
        self._all = False  # every shard (the Register done), not only those of _leases

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, every: float) -> None:
        """Beat every shard every ``every`` seconds from now on (once: a later start does nothing, but ends
        the beating of a Register under way, ``joined``, at the interval given)."""
        with self._mu:
            if self._all:
                return
            self._all, self._every = True, every
            self._spawn()

    def joined(self, shard: int, lease_s: float) -> None:
        """``shard`` answered a Register under way: keep its lease from now on (every lease / 3, the shortest
        of those that answered), while the others are still waited for."""
        with self._mu:
            if self._all or lease_s <= 0:
                return
            self._leases[shard] = lease_s
            self._every = min(self._leases.values()) / 3
            self._spawn()

    def _spawn(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"worker{self.worker_id}-heartbeat", daemon=True)
            self._thread.start()

    def _round(self) -> tuple[float, list[int] | None]:
        with self._mu:
            return self._every, None if self._all else sorted(self._leases)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beating (the worker is evicted once its lease runs out); waits for the thread up to ``timeout``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        t = self.transport
        while not self._stop.wait(self._round()[0]):
            every, shards = self._round()
            for i, stub in enumerate(t.stubs()):
                if self._stop.is_set():
                    return
                if shards is not None and i not in shards:
                    continue
                try:
                    def beat(stub: Any = stub, every: float = every) -> ps_pb2.HeartbeatResponse:
                        r: ps_pb2.HeartbeatResponse = stub.Heartbeat(
                            ps_pb2.HeartbeatRequest(worker_id=self.worker_id), timeout=every)
                        return r

                    r = t.attempt(i, beat)
                except ShardError as e:  # the data path reports failures; here only log them
                    log.debug("heartbeat to shard %d failed: %s", i, e.code)
                    continue
                except ValueError:  # the channel was closed under it (close() gave up waiting)
                    return
                if r.backup:  # a backup attached since registering (after a takeover, a spare)
                    t.set_backup(i, r.backup, stub)

    def leave(self, timeout: float) -> None:
        """Tell every shard this worker is done (``Leave``), so barriers go on without it at once. Best
        effort: a shard that does not answer within ``timeout`` seconds evicts the worker later."""
        t = self.transport

        def bye(i: int) -> None:
            try:
                t.attempt(i, lambda: t.stub(i).Leave(ps_pb2.LeaveRequest(worker_id=self.worker_id), timeout=timeout))
            except ShardError as e:
                log.info("worker %d: shard %d did not take its leave (%s); its lease will expire",
                         self.worker_id, i, e.code)

        t.fan_out(bye)
