"""One Ray cluster starting at a time on this machine, across the suite's processes.

The session's cluster (tests/conftest.py) runs in one xdist process; the tests that start clusters of their
own (tests/test_ray_own_cluster.py) run in the others, at the same time. Two `ray start`s at once on 2
cores were seen to time out ("node timed out during startup"); a running cluster beside another's start
does not. So starts take this lock (an flock: released if its holder dies), and only starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

LOCK_PATH = "/tmp/shardps-tests-ray-start.lock"


@contextlib.contextmanager
def ray_start_lock(timeout: float = 300.0) -> Iterator[None]:
    """Hold the machine's Ray start lock; raise TimeoutError after ``timeout`` s of waiting for it."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another Ray cluster was still starting after {timeout:.0f} s "
                                       f"({LOCK_PATH})") from None
                time.sleep(0.2)  # flock has no timeout of its own: polled, with a deadline
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
