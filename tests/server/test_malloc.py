"""``shardps server`` keeps freed memory for reuse (glibc's mallopt), so Pulls do not fault fresh pages in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from shardps.server.app import keep_freed_memory

glibc_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="the malloc tuning is glibc's (mallopt); on another C library shardps server leaves malloc as it is")

# In a fresh process (mallopt is process-wide): a thread that is not the main one frames 96 MB in 1 MiB
# messages, as a Pull's framing thread does, frees them, and does it again; the minor page faults of the
# second time are printed, with and without keep_freed_memory first.
_FRAME_TWICE = """
import json, resource, sys, threading
from shardps.server.app import keep_freed_memory
tuned = sys.argv[1] == "tuned" and keep_freed_memory()
chunk = bytes(1 << 20)
def frame():
    return [b"".join((b"h", chunk)) for _ in range(96)]
faults = []
def pull_twice():
    frame()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    frame()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=pull_twice)
t.start()
t.join()
print(json.dumps({"tuned": tuned, "faults": faults[0]}))
"""


def _faults(mode: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}  # that would keep glibc's arenas
    out = subprocess.run([sys.executable, "-c", _FRAME_TWICE, mode], capture_output=True, text=True, timeout=120,
                         check=True, env=env)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@glibc_only
def test_malloc_is_tuned_on_glibc():
    assert keep_freed_memory() is True


@glibc_only
def test_a_second_large_framing_in_a_thread_reuses_the_memory_of_the_first():
    tuned = _faults("tuned")
    assert tuned["tuned"] is True
    # 96 MB is 24576 pages: reused memory faults (next to) none of them in again.
    assert tuned["faults"] < 1000, tuned
    untuned = _faults("untuned")
    print(f"minor faults of the second 96 MB framing: {tuned['faults']} tuned, {untuned['faults']} untuned")
