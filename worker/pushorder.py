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

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


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
             wait_s: float, then: Callable[[int, T], None] | None = None) -> dict[int, T]:
    """``fn(shard)`` for each shard of ``order``, started in that order, at most ``window`` running at once.

    ``then(shard, result)`` runs as each call succeeds (in the thread that ran it). Every call runs even
    when one failed (a barrier must see every shard); once all ended, the first failure is raised.
    ``wait_s`` bounds each wait for a free place in the window (a call's own deadline and retries end
    sooner).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    free = threading.Semaphore(window)
    futures: dict[int, Future[T]] = {}

    def run(shard: int) -> T:
        try:
            value = fn(shard)
            if then is not None:
                then(shard, value)
            return value
        finally:
            free.release()

    try:
        for shard in order:
            if not free.acquire(timeout=wait_s):
                raise TimeoutError(f"no push of the window of {window} ended within {wait_s:.0f}s")
            try:
                futures[shard] = pool.submit(run, shard)
            except BaseException:
                free.release()
                raise
    finally:
        first: BaseException | None = None
        results: dict[int, T] = {}
        for shard, f in futures.items():
            try:
                results[shard] = f.result(timeout=wait_s)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after all ended
                first = first or e
    if first is not None:
        raise first
    return results
