"""Leases and membership of one shard's job: who is registered, evicted, gone.

``Membership`` holds the workers' leases and answers who counts for
barriers and SSP clocks. It takes no lock of its own (the store calls it
under its lock) and reads time only from the ``clock`` it is given, so
eviction is tested as a table with a fake clock (tests/server/test_membership.py).
``Reaper`` checks leases in the background, a few times per lease.

A worker is in one of: unknown, registered (holds a lease), evicted (its
lease expired: barriers go on without it; it may register again), left (said
goodbye with Leave; it may register again). When every worker has left and
none is evicted, the job ended: a worker registering starts the next run, in
which every worker is expected again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardps.server.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("shardps.server")

DEFAULT_LEASE_S = 10.0
Clock = Callable[[], float]


@dataclass(frozen=True)
class Joined:
    """What a registration changed."""

    new: bool  # a change the backup replays (not registered before, or evicted)
    live_changed: bool  # the set of live workers changed: barriers must look again
    rejoined: bool  # came back after an eviction or a Leave
    was_evicted: bool


class Membership:
    def __init__(self, shard_index: int, lease_s: float = DEFAULT_LEASE_S, clock: Clock = time.monotonic) -> None:
        self.shard_index = shard_index
        self.lease_s = lease_s
        self.clock = clock
        self.num_workers: int | None = None
        self.workers: set[int] = set()  # registered and live
        self.evicted: set[int] = set()
        self.left: set[int] = set()  # said goodbye (Leave): not expected, not an eviction
        self.last_seen: dict[int, float] = {}
        self.evictions_total = 0
        self.leaves_total = 0

    def live(self) -> set[int]:
        """Workers that count for barriers and SSP clocks: all of the job's but the evicted and those that left."""
        return set(range(self.num_workers or 0)) - self.evicted - self.left

    def check_worker_id(self, worker_id: int) -> None:
        if self.num_workers is None:
            raise FailedPrecondition(f"shard {self.shard_index} has no job yet: register first")
        if not 0 <= worker_id < self.num_workers:
            raise InvalidArgument(
                f"worker_id must be in [0, {self.num_workers}), got {worker_id}"
            )

    def check_registered(self, worker_id: int) -> None:
        if worker_id in self.evicted:
            raise FailedPrecondition(
                f"worker {worker_id} was evicted from shard {self.shard_index} (its lease of {self.lease_s:.1f}s "
                f"expired): register again to rejoin"
            )
        if worker_id in self.left:
            raise FailedPrecondition(
                f"worker {worker_id} left the job on shard {self.shard_index}: register again to rejoin"
            )
        if worker_id not in self.workers:
            raise FailedPrecondition(
                f"worker {worker_id} is not registered on shard {self.shard_index} "
                f"(registered: {sorted(self.workers)})"
            )

    def register(self, worker_id: int) -> Joined:
        """A worker joins (or rejoins): it holds a lease from now on."""
        new = worker_id not in self.workers or worker_id in self.evicted
        live_changed = False
        if self.left and not self.workers and not self.evicted:
            # Every worker had left: the job ended. A worker registering now starts its next run
            # (e.g. resumed from a checkpoint), in which every worker is expected again. (Not when
            # one was evicted: that one coming back to finish must not wait for those that did.)
            self.left.clear()
            live_changed = True
        self.workers.add(worker_id)
        self.last_seen[worker_id] = self.clock()
        was_evicted = worker_id in self.evicted
        rejoined = was_evicted or worker_id in self.left
        if rejoined:
            self.evicted.discard(worker_id)
            self.left.discard(worker_id)
            live_changed = True
        return Joined(new, live_changed, rejoined, was_evicted)

    def leave(self, worker_id: int) -> bool:
        """The worker said goodbye; False if it was not registered (nothing changes)."""
        if worker_id not in self.workers:
            return False
        self.workers.discard(worker_id)
        self.left.add(worker_id)
        self.last_seen.pop(worker_id, None)
        self.leaves_total += 1
        return True

    def touch(self, worker_id: int) -> None:
        """The worker is alive (any Push, Pull or Heartbeat renews its lease)."""
        if worker_id in self.workers:
            self.last_seen[worker_id] = self.clock()

    def renew_all(self) -> None:
        """A fresh lease for every registered worker (a restart, a takeover at a new address)."""
        now = self.clock()
        self.last_seen = {w: now for w in self.workers}

    def expired(self, now: float | None = None) -> list[int]:
        """Registered workers whose lease expired at ``now`` (default: the clock)."""
        now = self.clock() if now is None else now
        return [w for w in sorted(self.workers) if now - self.last_seen.get(w, now) > self.lease_s]

    def evict(self, expired: list[int], now: float | None = None) -> None:
        """Evict ``expired``: barriers complete with the live ones."""
        now = self.clock() if now is None else now
        for w in expired:
            self.workers.discard(w)
            self.evicted.add(w)
            self.evictions_total += 1
            log.warning("shard %d: evicted worker %d: no Push, Pull or Heartbeat for %.1fs (lease %.1fs); "
                        "steps now complete with workers %s", self.shard_index, w,
                        now - self.last_seen.get(w, now), self.lease_s, sorted(self.live()))

    def restore(self, workers: list[int], evicted: list[int], left: list[int], num_workers: int | None) -> None:
        self.workers, self.evicted, self.left = set(workers), set(evicted), set(left)
        self.num_workers = num_workers
        self.renew_all()  # a fresh lease after a restart


class Reaper:
    """Calls ``check`` in the background every ``period()`` seconds until stopped."""

    def __init__(self, check: Callable[[], object], period: Callable[[], float], name: str) -> None:
        self._check, self._period, self._name = check, period, name
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self._period()):
                self._check()

        self._thread = threading.Thread(target=loop, name=self._name, daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Stop the checks and wait for the thread to end."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
