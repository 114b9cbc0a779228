"""Deadlines kept by one thread: each item expires at its time unless it is done first, at no cost then.

A call that waits for nothing (a Pull parked on a shard, server/parked.py;
a frame on a worker's data connection, worker/datapath/dataconn.py) still has a
deadline. Rather than a thread per call, one ``Deadlines`` thread sleeps
until the earliest deadline; an item done before its time costs no wake-up
(it is dropped when the thread next looks, or when the heap is compacted).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Protocol

log = logging.getLogger("shardps")


class Timed(Protocol):
    """What ``Deadlines`` runs: ``expire()`` at ``deadline``, unless ``done`` by then."""

    @property
    def deadline(self) -> float: ...

    @property
    def done(self) -> bool: ...

    def expire(self) -> None: ...


class Deadlines:
    """One thread that expires each item at its deadline (``time.monotonic``) unless it is done by then,
    sleeping until the earliest live one (module docstring). ``close`` ends the thread (nothing left
    expires). Thread-safety: ``add`` from any thread."""

    def __init__(self, name: str = "shardps-deadlines") -> None:
        self._cv = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Timed]] = []
        self._ids = itertools.count()
        self._closed = False
        self._compact_at = 4096  # items done early wait in the heap until then: dropped at this size
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, item: Timed) -> None:
        with self._cv:
            if len(self._heap) >= self._compact_at:
                self._heap = [x for x in self._heap if not x[2].done]
                heapq.heapify(self._heap)
                self._compact_at = max(4096, 2 * len(self._heap))
            first = not self._heap or item.deadline < self._heap[0][0]
            heapq.heappush(self._heap, (item.deadline, next(self._ids), item))
            if first:
                self._cv.notify()

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cv:
                item = None
                while not self._closed:
                    while self._heap and self._heap[0][2].done:
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        item = heapq.heappop(self._heap)[2]
                        break
                    self._cv.wait(None if not self._heap else self._heap[0][0] - now)
                if item is None:
                    return
            try:
                item.expire()
            except Exception:  # noqa: BLE001 - one item's failure is its own; the others still expire
                log.exception("a deadline's callback failed")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
