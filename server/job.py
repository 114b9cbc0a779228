"""The job as one shard runs it: version, epoch, sync mode and policy, clocks, and the waits on them.

``Job`` is the part of the store that every request reads first: the
shard's version (one per optimizer step applied), the job's epoch (one per
rollback), the sync mode in force and its policy (server/sync.py), each
worker's last step (the exactly-once bookkeeping and the SSP clocks), the
Push counters, and whether the shard is closing or awaits a rollback
(``recovering``). No lock of its own: its fields are guarded by the store's
lock (``cond``), which the waits take. It learns who is live, whether its
shard was taken over, and which checkpoints exist from the callables it is
given (membership, the replica side, the checkpointer), never from them.

Every wait has a timeout and says, when it expires, what it waited for; a
halt (close), rollback (epoch) or takeover ends it early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import Aborted, DeadlineExceeded, Unavailable
from shardps.server.sync import SyncPolicy


class ByteCount:
    """A running total of bytes, added to from any thread (gRPC's, as Push messages arrive): a leaf lock of its
    own, so counting never waits for the store's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


class Job:
    """One shard's job state and its waits; see the module docstring. Fields read and written under ``cond``."""

    def __init__(self, shard_index: int, cond: threading.Condition, *, live: Callable[[], set[int]],
                 moved_to: Callable[[], str], checkpoints: Callable[[], list[int]]) -> None:
        self.shard_index = shard_index
        self._cond = cond
        self._live, self._moved_to, self._checkpoints = live, moved_to, checkpoints
        self.version = 0
        self.epoch = 0  # rollbacks of the job so far
        self.recovering = False  # restarted from a checkpoint: data RPCs wait for the job's rollback
        self.closing = False
        self.waiting = 0  # Pulls parked in a barrier/SSP/version wait right now
        self.sync: SyncSpec | None = None
        self.policy: SyncPolicy | None = None
        self.worker_clocks: dict[int, int] = {}  # each worker's last step taken in
        self.pushes_total = 0
        self.duplicate_pushes_total = 0
        self.push_bytes_total = 0
        self.received = ByteCount()  # Push messages as received, refused ones included (not in snapshots)
        self.sync_switches_total = 0

    @property
    def sync_text(self) -> str:
        """The sync mode in force as sent to workers ("" before the job is configured)."""
        return str(self.sync or "")

    def check_halted(self) -> None:
        """UNAVAILABLE when the shard is shutting down or was taken over by its backup."""
        if self.closing:
            raise Unavailable(f"shard {self.shard_index} is shutting down")
        moved_to = self._moved_to()
        if moved_to:
            raise Unavailable(f"shard {self.shard_index} was taken over by its backup at {moved_to}")

    def check_epoch(self, epoch: int | None) -> None:
        """ABORTED when the job was rolled back since the worker's epoch, or this shard awaits it."""
        if self.recovering:
            raise Aborted(f"shard {self.shard_index} restarted from its checkpoint at version {self.version}: "
                          f"the job must roll back to a checkpoint all shards hold "
                          f"(versions here: {self._checkpoints()})")
        if epoch is not None:
            self.check_same_epoch(epoch)

    def check_same_epoch(self, epoch: int) -> None:
        """ABORTED when the job was rolled back since the worker's epoch (``check_epoch`` without the
        restart's wait: a row push's check, as row tables serve before any rollback, docs/sparse.md)."""
        if epoch != self.epoch:
            raise Aborted(f"the job was rolled back (shard {self.shard_index} is in epoch {self.epoch}, "
                          f"the request in {epoch}): resync")

    def halted_since(self, epoch: int) -> bool:
        """Under the lock: whether a wait begun in ``epoch`` must end whatever it waits for (a halt, a
        rollback, a takeover: ``check_halted`` and ``check_epoch`` then say which)."""
        return self.closing or self.epoch != epoch or self._moved_to() != ""

    def count_waiting(self, delta: int) -> None:
        """Under the lock: a Pull parked without a thread (server/parked.py) counts in ``waiting`` too."""
        self.waiting += delta

    def _park(self, ready: Callable[[], bool], timeout: float) -> tuple[bool, int]:
        """Under the lock: park until ``ready`` or a halt, rollback or takeover; (ready, epoch at the start)."""
        start_epoch = self.epoch
        self.waiting += 1
        self._cond.notify_all()  # whoever watches ``waiting`` (a test at an exact point) looks again
        try:
            ok = self._cond.wait_for(lambda: ready() or self.halted_since(start_epoch), timeout)
        finally:
            self.waiting -= 1
            self._cond.notify_all()
        if ok:
            self.check_halted()
        return ok, start_epoch

    def slowest_clock(self) -> int:
        """Under the lock: the slowest live worker's clock (0 with none)."""
        c = self.clocks()
        return min(c.values()) if c else 0

    def wait_failure(self, min_version: int, min_clock: int, timeout: float) -> DeadlineExceeded:
        """Under the lock: the error of a wait for ``min_version`` and ``min_clock`` that ran out, naming
        what it still waits for (as ``wait_version`` and ``wait_clock`` raise it)."""
        if self.version < min_version:
            waiting = self.policy.waiting_on() if self.policy else "no job configured"
            return DeadlineExceeded(f"shard {self.shard_index} is at version {self.version}, waited {timeout:.1f}s "
                                    f"for version {min_version}: {waiting}")
        behind = {w: c for w, c in self.clocks().items() if c < min_clock}
        return DeadlineExceeded(f"shard {self.shard_index}: waited {timeout:.1f}s for every worker to reach clock "
                                f"{min_clock} ({self.sync}); behind: {behind}")

    def wait_version(self, min_version: int, timeout: float, epoch: int | None = None) -> int:
        """Block until the shard reaches ``min_version``; return the version then."""
        with self._cond:
            ok, start_epoch = self._park(lambda: self.version >= min_version, timeout)
            if ok:
                self.check_epoch(start_epoch if epoch is None else epoch)
                return self.version
            raise self.wait_failure(min_version, 0, timeout)

    def clocks(self) -> dict[int, int]:
        """Under the lock: the clocks of the live workers (the steps each pushed; evicted ones do not hold
        SSP back)."""
        return {w: self.worker_clocks.get(w, -1) + 1 for w in sorted(self._live())}

    def wait_clock(self, min_clock: int, timeout: float) -> int:
        """Block until every worker's clock is >= ``min_clock`` (SSP); return the slowest clock."""
        with self._cond:
            ok, start_epoch = self._park(lambda: self.slowest_clock() >= min_clock, timeout)
            if ok:
                self.check_epoch(start_epoch)
                return self.slowest_clock()
            raise self.wait_failure(0, min_clock, timeout)

    def close(self) -> None:
        """Shutting down: waits in progress end with UNAVAILABLE (they have left when this returns, or 5 s
        passed); ``check_halted`` refuses from now on."""
        with self._cond:
            self.closing = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.waiting == 0, timeout=5.0)  # parked waits have left
