"""The order of a step's pushes, and how many go up at once: a pull can start while later pushes go up.

A bsp step that pushes every shard's gradient at once and then pulls every
shard's weights keeps one direction of the worker's link idle at a time:
2 M / B for a model of M bytes on a link of B. When the model is cut into
many shards (a server host can serve several, ``shardps server --shards``),
a worker that pushes them a few at a time (``window``) and pulls each shard
as soon as that shard answered its push gets the weights of the first
shards down while the last ones are still going up, both directions busy
at once: towards M / B (BytePS's partitioned push and pull).

``push_order`` decides the order so that the workers of a job spread over
the server hosts: the shards are dealt round-robin over the hosts (the
address without its port), and worker w starts the round at host w, so at
any moment each host receives from as few workers as the counts allow.
``in_order`` runs the calls in that order, at most ``window`` at a time.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


def host_of(address: str) -> str:
    """The host part of ``HOST:PORT`` (``[v6]:PORT`` too)."""
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() else address


def push_order(addresses: Sequence[str], worker_id: int) -> list[int]:
    """The shards in the order worker ``worker_id`` pushes them (see the module docstring).

    Shards are grouped by host in shard order; round r takes the r-th shard of
    every host that has one, starting at host ``worker_id mod hosts``.
    """
    hosts: dict[str, list[int]] = {}
    for shard, address in enumerate(addresses):
        hosts.setdefault(host_of(address), []).append(shard)
    groups = list(hosts.values())
    if not groups:
        return []
    start = worker_id % len(groups)
    groups = groups[start:] + groups[:start]
    order: list[int] = []
    for r in range(max(len(g) for g in groups)):
        order.extend(g[r] for g in groups if r < len(g))
    return order


def in_order(pool: ThreadPoolExecutor, fn: Callable[[int], T], order: Sequence[int], *, window: int,
             wait_s: float, then: Callable[[int, T], None] | None = None,
             soon: Soon[T] | None = None) -> dict[int, T]:
    """``fn(shard)`` for each shard of ``order``, started in that order, at most ``window`` running at once.

    ``then(shard, result)`` runs as each call succeeds (in the thread that ended it). Every call runs even
    when one failed (a barrier must see every shard); once all ended, the first failure is raised.
    ``wait_s`` bounds each wait for a call to end (a call's own deadline and retries end sooner).

    ``soon(shard, done)``: start the shard's call as a frame that waits for nothing (a data connection's,
    worker/datapath/dataconn.py), ``done(result, None)`` or ``done(None, error)`` run as it ends, in the connection's
    reading thread, which then starts the next call of the window itself: no thread of the pool, no
    hand-over between threads. It returns False where the shard's path has no such call (``fn`` runs in a
    pool thread instead), and its ``error`` is None-mapped by ``soon.settle`` where the call is to be made
    again with ``fn`` (its retries, a fail-over).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return _Window(pool, fn, order, window, then, soon).run(wait_s)


class Soon(Protocol[T_co]):
    """A call that waits for nothing (``in_order``)."""

    def __call__(self, shard: int, done: Callable[[T_co | None, Exception | None], None]) -> bool: ...

    def settle(self, shard: int, error: Exception) -> Exception | None:
        """The failure to record for ``error``, or None: make the call again with ``fn``."""
        ...


class _Window(Generic[T]):
    """``in_order``'s calls: started as places in the window free, by whichever thread ended the last."""

    def __init__(self, pool: ThreadPoolExecutor, fn: Callable[[int], T], order: Sequence[int], window: int,
                 then: Callable[[int, T], None] | None, soon: Soon[T] | None) -> None:
        self._pool, self._fn, self._order, self._then, self._soon = pool, fn, list(order), then, soon
        self._cv = threading.Condition(threading.Lock())
        self._free = window
        self._next = 0
        self._stopped = False
        self._ended: dict[int, tuple[T | None, BaseException | None]] = {}

    def run(self, wait_s: float) -> dict[int, T]:
        self._fill()
        with self._cv:
            seen = -1
            # Woken once, as the last call ends (not at each: a wake-up is a hand-over between threads);
            # every ``wait_s`` it looks whether any call ended meanwhile.
            while len(self._ended) < len(self._order):
                if len(self._ended) == seen:
                    self._stopped = True  # start nothing more; what runs ends by its own deadline
                    raise TimeoutError(f"no push of the window ended within {wait_s:.0f}s")
                seen = len(self._ended)
                self._cv.wait_for(lambda: len(self._ended) == len(self._order), wait_s)
            ended = dict(self._ended)
        results: dict[int, T] = {}
        for shard in self._order:
            value, error = ended[shard]
            if error is not None:
                raise error
            results[shard] = value  # type: ignore[assignment]
        return results

    def _fill(self) -> None:
        """Start calls while the window has room."""
        while True:
            with self._cv:
                if self._stopped or self._free == 0 or self._next == len(self._order):
                    return
                shard = self._order[self._next]
                self._next += 1
                self._free -= 1
            self._start(shard)

    def _start(self, shard: int) -> None:
        if self._soon is not None:
            try:
                if self._soon(shard, functools.partial(self._answered, shard)):
                    return
            except Exception as e:  # noqa: BLE001 - recorded as the shard's failure, or made again with fn
                again = self._soon.settle(shard, e)
                if again is not None:
                    self._end(shard, None, again)
                    return
        try:
            self._pool.submit(self._call, shard)
        except BaseException as e:  # noqa: BLE001 - the pool is shut (the client closes): the shard's failure
            self._end(shard, None, e)

    def _answered(self, shard: int, value: T | None, error: Exception | None) -> None:
        if error is not None:
            assert self._soon is not None
            mapped = self._soon.settle(shard, error)
            if mapped is None:  # made again through fn (its retries)
                try:
                    self._pool.submit(self._call, shard)
                except BaseException as e:  # noqa: BLE001 - the pool is shut (the client closes)
                    self._end(shard, None, e)
                return
            self._end(shard, None, mapped)
            return
        self._end(shard, value, None)

    def _call(self, shard: int) -> None:
        try:
            value = self._fn(shard)
        except BaseException as e:  # noqa: BLE001 - recorded; raised by run() once every call ended
            self._end(shard, None, e)
            return
        self._end(shard, value, None)

    def _end(self, shard: int, value: T | None, error: BaseException | None) -> None:
        if error is None and self._then is not None:
            try:
                self._then(shard, value)  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - the shard's failure
                error = e
        with self._cv:
            self._ended[shard] = (value, error)
            self._free += 1
            if len(self._ended) == len(self._order):
                self._cv.notify_all()
        self._fill()
