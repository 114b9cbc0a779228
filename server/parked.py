"""Waits without a thread: a Pull parked on the shard's state, answered by whoever changes that state.

A Pull that must wait (bsp: for the round's last gradient; ssp: for the
slowest worker) used to hold a thread blocked on the shard's condition, and
every change woke each such thread to look (one hand-off between threads per
Pull, twice: the wake-up and the answer). On the data connection it parks
instead (``Parked.park``): a predicate on the shard's state and what to do
once it holds. The shard's condition is a ``Signal``: every ``notify_all``
(every change a waiter could care for: a version, a clock, a halt, a
rollback, a takeover) also asks the parked Pulls, under the lock, which are
due; those run once the lock is released, in the thread that released it,
which is the thread that made the change: the round's last push, read by its
connection's thread, answers the Pulls its round released (BytePS's shape:
the part's weights go out as soon as the part is applied).

A parked Pull also has a deadline (protos/deadlines.py: one thread for all
of a data port's parked Pulls, sleeping until the earliest); past it, it runs with
``timed_out`` and answers as a thread's wait would (DEADLINE_EXCEEDED,
naming what it waited for).

A parked Pull counts in ``Job.waiting`` from its parking until it is due, as
a thread parked in ``Job._park`` does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from shardps.protos.deadlines import Deadlines

log = logging.getLogger("shardps.server")

Due = Callable[[bool], None]
"""What a parked Pull runs once due: called with ``timed_out``, outside the lock."""


class Signal(threading.Condition):
    """The shard's condition (a plain lock): ``notify_all`` also hands the change to ``hooks`` (called under
    the lock; each may ``defer`` work), and the deferred work runs as the lock is released, in that thread,
    after the release."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.hooks: list[Callable[[], None]] = []
        self._deferred: list[Callable[[], None]] = []

    def notify_all(self) -> None:
        super().notify_all()
        for hook in self.hooks:
            hook()

    def watched(self) -> bool:
        """Under the lock: whether any thread waits on the condition (a wake-up would reach someone)."""
        return bool(self._waiters)  # type: ignore[attr-defined]

    def defer(self, fn: Callable[[], None]) -> None:
        """Under the lock: run ``fn`` once the lock is released (by whichever thread releases it next)."""
        self._deferred.append(fn)

    def __exit__(self, *exc: Any) -> None:
        deferred = self._deferred
        if deferred:
            self._deferred = []
        super().__exit__(*exc)
        for fn in deferred:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one parked call's failure is its own (answered by it), not ours
                log.exception("a parked call failed")


class _Entry:
    __slots__ = ("ready", "due", "deadline", "epoch", "done", "_expired")

    def __init__(self, ready: Callable[[], bool], due: Due, deadline: float, epoch: int,
                 expired: Callable[[_Entry], None]) -> None:
        self.ready, self.due, self.deadline, self.epoch, self.done = ready, due, deadline, epoch, False
        self._expired = expired  # no cycle through a closure: an entry goes with its last reference

    def expire(self) -> None:
        self._expired(self)


class Parked:
    """One shard's parked Pulls (module docstring). ``halted(epoch)``: under the lock, whether a wait begun in
    ``epoch`` must end now whatever its predicate (a halt, a rollback, a takeover)."""

    def __init__(self, cond: Signal, halted: Callable[[int], bool], count: Callable[[int], None]) -> None:
        self._cond, self._halted, self._count = cond, halted, count
        self._entries: list[_Entry] = []
        cond.hooks.append(self._check)

    def park(self, ready: Callable[[], bool], due: Due, deadline: float, epoch: int, deadlines: Deadlines) -> None:
        """Under the lock: run ``due(False)`` once ``ready()`` holds or the wait must end (``halted``), or
        ``due(True)`` at ``deadline`` (``time.monotonic``, kept by ``deadlines``), whichever is first; never
        both."""
        e = _Entry(ready, due, deadline, epoch, self._expire)
        self._entries.append(e)
        self._count(+1)
        deadlines.add(e)
        if self._cond.watched():  # whoever watches the waits (a test holding a Pull at an exact point)
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._entries)

    def _check(self) -> None:
        """Under the lock, after a change: the entries now due, deferred to the lock's release."""
        if not self._entries:
            return
        keep = []
        for e in self._entries:
            if e.ready() or self._halted(e.epoch):
                e.done = True
                self._count(-1)
                self._cond.defer(lambda e=e: e.due(False))  # type: ignore[misc]
            else:
                keep.append(e)
        self._entries = keep

    def _expire(self, e: _Entry) -> None:
        """The deadlines' thread: ``e`` ran past its deadline (unless it was due first)."""
        with self._cond:
            if e.done:
                return
            e.done = True
            self._count(-1)
            self._entries.remove(e)
            self._cond.defer(lambda: e.due(True))
