"""worker/streaming/heap.py: with the mmap threshold fixed, freed blocks leave the process's RSS (glibc).

Regression pinned: a streamed worker's peak RSS was above the resident one's, because glibc raised its mmap
threshold at the first large free and kept every later freed weight in its heap. Each case runs in a fresh
interpreter (the allocator's state is per process): one 16 MiB block freed first raises the threshold, then
64 blocks of 1 MiB are allocated, touched and freed (each followed by a small block kept, as a process's
other allocations are); the RSS they give back is read from /proc.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CASE = """
import json, sys
from shardps.worker.streaming import heap
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
fixed = heap.give_back_freed_memory() if sys.argv[1] == "fixed" else False
big = bytearray(16 << 20)
del big  # a large mapped block freed: glibc raises its threshold to 16 MiB
blocks, fences = [], []
for _ in range(64):
    blocks.append(bytearray(1 << 20))  # zero-filled: every page touched
    fences.append(bytearray(4096))  # kept: the freed blocks are not the heap's top, which glibc would trim
before = rss()
del blocks
print(json.dumps({"fixed": fixed, "freed_back": before - rss()}))
"""


def _run(mode: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", CASE, mode], capture_output=True, text=True, timeout=60,
                          check=True, env={"PATH": "/usr/bin:/bin"})
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc: Linux only")
def test_freed_blocks_leave_the_rss_once_the_threshold_is_fixed():
    fixed, raised = _run("fixed"), _run("raised")
    assert fixed["fixed"] is True
    assert fixed["freed_back"] > 48 << 20, fixed  # the 64 MiB went back to the system
    assert raised["freed_back"] < 16 << 20, raised  # without the call glibc keeps them: what the call is for
