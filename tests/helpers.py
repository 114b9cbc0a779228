"""Test helpers: run worker functions in threads and re-raise their first error."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_workers(fn: Callable[[int], Any], n: int, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(worker_id)`` for ids 0..n-1 in parallel threads; return their results."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def target(k: int) -> None:
        try:
            results[k] = fn(k)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=target, args=(k,), name=f"worker{k}") for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{t.name} did not finish within {timeout}s")
    if errors:
        raise errors[0]
    return results
