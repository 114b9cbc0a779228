"""Freed memory given back to the system on a CPU worker (glibc's allocator), for streamed weights.

glibc serves a request of at least its mmap threshold (128 KiB at start) with a mapping of its own, returned
to the system when freed; smaller ones come from its heap, whose freed blocks stay in the process. It raises
that threshold to the size of each mapped block freed (up to 32 MiB), so after the first large tensors are
freed, tensors of that size come from the heap and their pages stay in the process's RSS once freed. A
streamed worker frees and allocates its weights unit by unit, so without a fixed threshold the storage it
releases never leaves: measured on the char-GPT (25M parameters, budget 16 MiB), the streamed worker's peak
RSS was above the resident one's (docs/streaming.md).

``give_back_freed_memory()`` fixes the threshold (which also stops glibc's raising it), so blocks of 128 KiB
and more are mapped and unmapped on free; ``trim()`` gives back what the heap already holds free (blocks
allocated before the threshold was fixed: the model's weights as it was built, released once streamed).
Process-wide and once: a user's own ``MALLOC_MMAP_THRESHOLD_``
(read by glibc at start) is left alone, as is any other allocator (the call answers False where glibc's
``mallopt`` is not there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value

_lock = threading.Lock()
_done: bool | None = None
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return None
    return _libc


def give_back_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 128 KiB for this process (see the module docstring); True when it is
    fixed now (by this call or an earlier one), False where it is not (another allocator, another libc, or
    the user's ``MALLOC_MMAP_THRESHOLD_`` already chose)."""
    global _done
    with _lock:
        if _done is None:
            _done = False
            mallopt = getattr(_c(), "mallopt", None)
            if "MALLOC_MMAP_THRESHOLD_" not in os.environ and mallopt is not None:
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _done = mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
        return _done


def trim() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is no
    such call. Walks the heap: milliseconds, for a start, not for every step."""
    fn = getattr(_c(), "malloc_trim", None)
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    fn(0)
    return True
