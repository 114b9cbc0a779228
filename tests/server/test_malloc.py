"""``shardps server`` keeps freed memory for reuse (glibc's mallopt), so Pulls do not fault fresh pages in."""

from __future__ import annotations

import platform

import pytest

from shardps.server.app import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_malloc_is_tuned_on_glibc():
    assert keep_freed_memory() is True
