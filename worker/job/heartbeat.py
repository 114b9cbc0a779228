"""Heartbeats: a registered worker renews its lease on every shard in the background.

Push and Pull renew the lease too; heartbeats keep a worker that computes for
longer than its lease from being evicted. ``PSClient.register`` starts them
(every lease / 3), ``close()`` stops them; the thread checks for a stop
between shards, so stopping never waits for more than the call under way.
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

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, every: float) -> None:
        """Beat every ``every`` seconds from now on (once: a second start does nothing)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, args=(every,), name=f"worker{self.worker_id}-heartbeat",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beating (the worker is evicted once its lease runs out); waits for the thread up to ``timeout``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _loop(self, every: float) -> None:
        t = self.transport
        while not self._stop.wait(every):
            for i, stub in enumerate(t.stubs()):
                if self._stop.is_set():
                    return
                try:
                    def beat(stub: Any = stub) -> ps_pb2.HeartbeatResponse:
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
