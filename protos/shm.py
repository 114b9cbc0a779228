"""Shared-memory segments for the same-host fast path: tensor bytes beside the calls, not in them.

A worker that shares a machine with a shard makes one segment per shard
and direction (``create``): it writes its gradients into the push segment
and sends a Push whose chunks say where they lie (``Chunk.shm_offset``,
``shm_bytes``) instead of carrying them; the shard writes the weights of a
Pull into the worker's pull segment and answers with such chunks. The
calls (frames on the worker's data connection to the shard's process, or
gRPC calls without one) carry the control messages only. Whether the two share ``/dev/shm`` is
not guessed from addresses: at Register the worker names a probe segment
holding a random token, and the shard says whether it read it
(``RegisterResponse.shm``). Otherwise everything goes through gRPC.

Segments are files in ``/dev/shm`` named ``shardps-...``; the worker that
made them removes them when its client closes (and at exit), and holds a
lock on each while it lives: a worker that died without removing its own
(SIGKILL, the OOM killer) has them removed by the next worker that
registers on the machine (``remove_stale``).
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import re
import secrets
import threading
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME = re.compile(r"shardps-[A-Za-z0-9_.-]{1,200}")
_ALIGN = 64  # every part starts on a cache line


def available() -> bool:
    """Whether this machine has a /dev/shm to make segments in."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"shared-memory segment name {name[:80]!r}: expected 'shardps-' and letters, digits, "
                         f"'_', '.', '-'")
    return name


class SegmentClosed(ValueError):
    """The segment was closed (unmapped) before a view of it was taken."""


class Segment:
    """A mapped segment: ``view(offset, nbytes)`` is a memoryview of its bytes (bounds checked)."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, *, owner: bool, fd: int = -1) -> None:
        self.name, self.size, self._mm, self.owner = name, size, mm, owner
        self._fd = fd  # the maker's: it holds the file's lock while it lives (see remove_stale)
        self._buf = memoryview(mm)
        self.closed = False

    def view(self, offset: int, nbytes: int) -> memoryview:
        """SegmentClosed once ``close`` ran (another thread may close it: a worker's fail-over)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"shared-memory segment {self.name}: bytes [{offset}, {offset + nbytes}) outside its "
                             f"{self.size} bytes")
        try:
            return self._buf[offset : offset + nbytes]
        except ValueError:  # released by close()
            if self.closed:
                raise SegmentClosed(f"shared-memory segment {self.name} was closed") from None
            raise

    def release(self, offset: int, nbytes: int) -> int:
        """Give the pages wholly or partly in ``[offset, offset + nbytes)`` back to the system, from the first page
        boundary at or after ``offset`` (``madvise(MADV_REMOVE)``: the file's backing pages are freed for every
        process that maps it; the next write there faults in a zeroed page). Only for bytes nobody reads or
        writes any more. The bytes given back (0 when the range holds no whole page)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"shared-memory segment {self.name}: bytes [{offset}, {offset + nbytes}) outside its "
                             f"{self.size} bytes")
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = offset + nbytes
        if end <= start or self.closed:
            return 0
        remove = getattr(mmap, "MADV_REMOVE", None)
        if remove is None:
            raise OSError("this system has no madvise(MADV_REMOVE): the pages stay")
        self._mm.madvise(remove, start, end - start)
        return end - start

    def close(self) -> None:
        """Unmap (and, for the worker that made it, remove the file). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:  # a view still exported (a tensor over it): the mapping goes with the last one
            pass
        if self.owner:
            _owned.discard(self.name)
            try:
                (SHM_DIR / self.name).unlink()
            except FileNotFoundError:
                pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_owned: set[str] = set()
_lock = threading.Lock()


def _remove_owned() -> None:
    for name in list(_owned):
        try:
            (SHM_DIR / name).unlink()
        except FileNotFoundError:
            pass


atexit.register(_remove_owned)


def create(tag: str, size: int) -> Segment:
    """A new segment of ``size`` bytes (at least 1), named ``shardps-<pid>-<tag>-<random>``, removed at exit."""
    name = check_name(f"shardps-{os.getpid()}-{tag}-{secrets.token_hex(4)}")
    size = max(1, size)
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives: it is in use
        # Reserve the pages now: a tmpfs too small (a container's 64 MB /dev/shm) then fails here, with
        # OSError (ENOSPC), instead of killing the process with SIGBUS on first write.
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:  # pragma: no cover - not Linux
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        (SHM_DIR / name).unlink(missing_ok=True)
        raise
    with _lock:
        _owned.add(name)
    return Segment(name, size, mm, owner=True, fd=fd)


def remove_stale(min_age_s: float = 60.0) -> list[str]:
    """Remove the segments whose maker died without removing them (a SIGKILL, the OOM killer): each maker
    holds a lock on its files while it lives, released by the kernel when it dies, in any PID namespace.
    Files younger than ``min_age_s`` are left alone (a maker between making and locking). Returns the names
    removed."""
    gone = []
    now = time.time()
    for path in SHM_DIR.glob("shardps-*"):
        if not NAME.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # locked: its maker lives
                continue
            path.unlink(missing_ok=True)
            gone.append(path.name)
        finally:
            os.close(fd)
    return gone


def open_segment(name: str) -> Segment:
    """Map an existing segment made by another process (ValueError for a bad name; OSError if missing)."""
    check_name(name)
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size <= 0:
            raise ValueError(f"shared-memory segment {name} is empty")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return Segment(name, size, mm, owner=False)


def probe() -> tuple[Segment, bytes] | None:
    """A probe segment holding a random token (None where /dev/shm is missing)."""
    if not available():
        return None
    token = secrets.token_bytes(16)
    seg = create("probe", len(token))
    seg.view(0, len(token))[:] = token
    return seg, token


def read_probe(name: str, token: bytes) -> bool:
    """Whether the segment ``name`` exists here and holds ``token`` (the server's half of the probe)."""
    if not name or not token:
        return False
    try:
        seg = open_segment(name)
    except (OSError, ValueError):
        return False
    try:
        return seg.size >= len(token) and bytes(seg.view(0, len(token))) == token
    finally:
        seg.close()
