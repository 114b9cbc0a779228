"""Leases and membership of one shard's job: who is registered, evicted, gone.

``Membership`` holds the workers' leases and answers who counts for
barriers and SSP clocks. It takes no lock of its own (the store calls it
under its lock) and reads time only from the ``clock`` it is given, so
eviction is tested as a table with a fake clock (tests/server/test_membership.py).
``Reaper`` checks leases in the background, a few times per lease.
``Leases`` is the store's part: ``Membership`` and its reaper, given the
store's lock and a ``Recorder`` for the changes its backup replays.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardps.server.errors import FailedPrecondition, InvalidArgument
from shardps.server.replication.roles import OpKind, Recorder

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
        # Workers that registered again after an eviction and have not pushed since: a worker comes back with one
        # clock for every shard, the newest (worker/client.py), so a shard it fell behind on skips it to that clock
        # with its next push instead of refusing the step as a gap (docs/operations.md, "Rejoin").
        self.skips: set[int] = set()
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
        if was_evicted:  # it went on elsewhere meanwhile: its next push may skip its clock here ahead
            self.skips.add(worker_id)
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

    def restore(self, workers: list[int], evicted: list[int], left: list[int], num_workers: int | None,
                skips: Iterable[int] = ()) -> None:
        self.workers, self.evicted, self.left, self.skips = set(workers), set(evicted), set(left), set(skips)
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



class Leases:
    """Membership as a part of the store: the leases, their reaper, and each change recorded.

    Given the store's lock (``cond``; its methods take it, the ``*_locked``
    ones expect it held), the ``Recorder`` the backup's ops go to, the
    ``Membership`` (shared with no other part but read by the job's clocks), and three
    callables: ``on_live_changed`` (under the lock, with the live workers:
    the sync policy may complete a barrier), ``may_evict`` (only a serving
    primary evicts; a backup replays its primary's evictions) and
    ``clock_of`` (a worker's clock, for the log).
    """

    def __init__(self, cond: threading.Condition, recorder: Recorder, membership: Membership, *,
                 on_live_changed: Callable[[set[int]], None] = lambda live: None,
                 may_evict: Callable[[], bool] = lambda: True,
                 clock_of: Callable[[int], int] = lambda worker: 0) -> None:
        self.shard_index = shard_index = membership.shard_index
        self.clock = membership.clock
        self.membership = membership
        self._cond, self._recorder = cond, recorder
        self._on_live_changed, self._may_evict, self._clock_of = on_live_changed, may_evict, clock_of
        self._reaper = Reaper(self.evict_expired, lambda: max(0.05, self.lease_s / 4), f"shard{shard_index}-leases")

    @property
    def lease_s(self) -> float:
        return self.membership.lease_s

    @lease_s.setter
    def lease_s(self, value: float) -> None:
        self.membership.lease_s = value

    @property
    def evictions_total(self) -> int:
        return self.membership.evictions_total

    @property
    def leaves_total(self) -> int:
        return self.membership.leaves_total

    @leaves_total.setter
    def leaves_total(self, value: int) -> None:  # restored with the counters
        self.membership.leaves_total = value

    def register(self, worker_id: int) -> None:
        """A worker joins (or rejoins after an eviction): it holds a lease from now on."""
        with self._cond:
            self.membership.check_worker_id(worker_id)
            m = self.membership
            if worker_id not in m.workers or worker_id in m.evicted:  # a change the backup replays
                self._recorder.record(OpKind.REGISTER_WORKER, {"worker": worker_id})
            joined = m.register(worker_id)
            if joined.rejoined:
                log.log(logging.WARNING if joined.was_evicted else logging.INFO,
                        "shard %d: worker %d rejoined at clock %d", self.shard_index, worker_id,
                        self._clock_of(worker_id))
            if joined.live_changed:
                self._live_changed()

    def leave(self, worker_id: int) -> bool:
        """A worker is done and says so: from now on barriers and SSP clocks go on without it.

        Unlike an eviction this is the normal end of a worker (no warning,
        no ``evictions_total``). Idempotent; registering again rejoins.
        Returns whether the worker was registered.
        """
        with self._cond:
            self.membership.check_worker_id(worker_id)
            if worker_id not in self.membership.workers:
                return False
            self._recorder.record(OpKind.LEAVE, {"worker": worker_id})
            self.membership.leave(worker_id)
            log.info("shard %d: worker %d left at clock %d; steps now complete with workers %s", self.shard_index,
                     worker_id, self._clock_of(worker_id), sorted(self.live()))
            self._live_changed()
            return True

    def touch(self, worker_id: int) -> None:
        """The worker is alive (any Push, Pull or Heartbeat renews its lease)."""
        with self._cond:
            self.membership.touch(worker_id)

    def live(self) -> set[int]:
        """Workers that count for barriers and SSP clocks: all of the job's but the evicted and those that left."""
        return self.membership.live()

    def _live_changed(self) -> None:
        self._on_live_changed(self.live())
        self._cond.notify_all()

    def evict_expired(self, now: float | None = None) -> list[int]:
        """Evict registered workers whose lease expired; barriers complete with the live ones."""
        now = self.clock() if now is None else now
        with self._cond:
            if not self._may_evict():  # a backup replays its primary's evictions; a starting one waits
                return []
            expired = self.membership.expired(now)
            self.evict_locked(expired, now)
            return expired

    def evict(self, workers: list[int]) -> None:
        """Evict ``workers`` now, as the reaper evicts those whose lease ran out (a backup replaying its primary's
        eviction; a test that evicts at an exact point)."""
        with self._cond:
            self.evict_locked(workers)

    def evict_locked(self, expired: list[int], now: float | None = None) -> None:
        """Under the lock: evict ``expired`` (recorded; barriers go on without them)."""
        if expired:
            self._recorder.record(OpKind.EVICT, {"workers": expired})
            self.membership.evict(expired, now)
            self._live_changed()

    def start_reaper(self) -> None:
        """Check leases in the background, a few times per lease."""
        if self.lease_s > 0:
            self._reaper.start()

    def signal_stop(self) -> None:
        """Tell the reaper to stop (at once; ``stop_reaper`` also waits for its thread)."""
        self._reaper.signal_stop()

    def stop_reaper(self) -> None:
        """Stop the lease checks and wait for the thread to end."""
        self._reaper.stop()
