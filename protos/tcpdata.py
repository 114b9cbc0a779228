"""The TCP bulk path's wire: tensor bytes on a plain TCP connection beside gRPC, one per (worker, shard).

gRPC stays the control plane: a Push's messages and a Pull's answers are
those of the same-host path (protos/shm.py: chunks that say where their
bytes lie, ``Chunk.shm_offset``/``shm_bytes``, no data), and the segment
they name is a buffer on the other end of the data connection (a "remote
segment"), named ``tcp-<seq>``: ``seq`` numbers the worker's pushes (and
pulls) on that shard, so that the bytes of one are never taken for
another's.

On the connection:

- the worker's hello (``HELLO``: the token the shard gave it in its
  RegisterResponse, the sizes of the two buffers, its deadline in seconds),
  answered by the shard's ``ACK`` once the connection serves;
- then frames in both directions (``FRAME``: seq, offset, nbytes, then
  nbytes of payload): the worker's push bytes, landing at ``offset`` of the
  shard's push buffer; the shard's pull answers, at ``offset`` of the
  worker's pull buffer.

A ``Receiver`` thread on each end reads frames into its buffer and
remembers, for the latest seq, which (offset, nbytes) arrived; ``wait``
blocks (with a deadline) until the frame a message names is in, and raises
``DataError`` saying what was expected and what was received when it is
torn (the connection ended or stalled mid-frame), of another size, or
superseded. Every read and write has a deadline (the socket's timeout); an
idle connection just waits for the next frame.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

PREFIX = "tcp-"
HELLO = struct.Struct("!4s16sQQd")  # b"SPH1", token, push buffer bytes, pull buffer bytes, deadline (s)
ACK = struct.Struct("!4sI")  # b"SPA1", 0
FRAME = struct.Struct("!4sQQQ")  # b"SPD1", seq, offset, nbytes
HELLO_MAGIC, ACK_MAGIC, FRAME_MAGIC = b"SPH1", b"SPA1", b"SPD1"


class DataError(ValueError):
    """A frame a message named is not there as it said (torn, another size, superseded, never came)."""


def segment_name(seq: int) -> str:
    return f"{PREFIX}{seq}"


def parse_name(name: str) -> int:
    """The seq of a segment name ``tcp-<seq>``; ValueError for another name."""
    if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
        raise ValueError(f"data segment name {name[:80]!r}: expected '{PREFIX}' and a number")
    return int(name[len(PREFIX):])


def tune(sock: socket.socket, timeout: float) -> None:
    """No Nagle delay, and a deadline on every blocking call. The buffers are left to the kernel's
    autotuning: fixed 4 MiB ones let every connection put megabytes into a shaped link's queue at once
    (docs/performance.md, the simulated cluster)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)


class Torn(Exception):
    def __init__(self, got: int, why: str) -> None:
        super().__init__(why)
        self.got, self.why = got, why


def fill(sock: socket.socket, view: memoryview, idle: Callable[[], bool] | None = None) -> None:
    """Read exactly ``len(view)`` bytes into ``view``; ``Torn`` (with the count received) when the peer
    ends or stalls past the socket's deadline first. ``idle``: while nothing at all was read, a timeout
    only asks it whether to go on waiting (an idle connection)."""
    n = 0
    while n < len(view):
        try:
            k = sock.recv_into(view[n:])
        except TimeoutError:
            if n == 0 and idle is not None and idle():
                continue
            raise Torn(n, "stalled past the deadline") from None
        except OSError as e:
            raise Torn(n, f"connection failed ({e.strerror or e})") from None
        if k == 0:
            raise Torn(n, "connection closed")
        n += k


def send_frame(sock: socket.socket, lock: threading.Lock, seq: int, offset: int, data: memoryview) -> None:
    """One frame: its header, then ``data`` straight from the caller's memory (no copy)."""
    with lock:
        sock.sendall(FRAME.pack(FRAME_MAGIC, seq, offset, data.nbytes))
        if data.nbytes:
            sock.sendall(data)


class Receiver:
    """Reads frames from ``sock`` into ``buf`` in a thread of its own (module docstring).

    ``on_end(reason)`` runs in that thread when the connection ends for
    another reason than ``close`` (the peer went, a protocol error);
    ``counted(nbytes)`` after each whole frame.
    """

    def __init__(self, sock: socket.socket, buf: memoryview, what: str,
                 on_end: Callable[[str], None] | None = None, counted: Callable[[int], None] | None = None) -> None:
        self._sock, self._buf, self._what, self._on_end = sock, buf, what, on_end
        self._counted = counted  # handed each whole frame's size, header included
        self._cond = threading.Condition()
        self.seq = -1  # the latest seq a frame came with
        self._frames: dict[int, int] = {}  # offset -> nbytes of the latest seq's frames that arrived whole
        self._torn: tuple[int, int, int, int] | None = None  # seq, offset, nbytes, received
        self.error = ""  # why the connection ended ('' while it serves)
        self.closed = False
        self._thread = threading.Thread(target=self._run, name=f"shardps-tcp-{what}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        head = bytearray(FRAME.size)
        why = ""
        try:
            while True:
                fill(self._sock, memoryview(head), idle=lambda: not self.closed)
                magic, seq, offset, nbytes = FRAME.unpack(head)
                if magic != FRAME_MAGIC:
                    why = f"not a data frame (starts {bytes(magic)!r})"
                    return
                if offset + nbytes > len(self._buf):
                    why = f"frame [{offset}, {offset + nbytes}) outside the {len(self._buf)}-byte buffer"
                    return
                with self._cond:
                    if seq != self.seq:
                        self.seq, self._frames = seq, {}
                    self._frames.pop(offset, None)
                try:
                    fill(self._sock, self._buf[offset : offset + nbytes])
                except Torn as t:
                    with self._cond:
                        self._torn = (seq, offset, nbytes, t.got)
                    why = f"frame torn: {t.why}"
                    return
                with self._cond:
                    self._frames[offset] = nbytes
                    self._cond.notify_all()
                if self._counted is not None:
                    self._counted(FRAME.size + nbytes)
        except Torn as t:
            why = "" if self.closed else f"{t.why} between frames"
        except Exception as e:  # noqa: BLE001 - whatever ends the reading ends the connection, said below
            why = f"{type(e).__name__}: {e}"
        finally:
            with self._cond:
                self.error = why or "closed"
                self._cond.notify_all()
            if not self.closed and self._on_end is not None:
                self._on_end(self.error)

    def _within(self, offset: int, nbytes: int) -> bool:
        return any(o <= offset and offset + nbytes <= o + n for o, n in self._frames.items())

    def wait(self, seq: int, offset: int, nbytes: int, timeout: float, *, exact: bool = True) -> memoryview:
        """The bytes of the frame of ``seq`` at ``offset``, once it came whole (``exact=False``: the bytes
        [offset, offset + nbytes) of any frame of ``seq`` that holds them); ``DataError`` saying what was
        expected and received when it is torn, of another size, superseded, or not in within ``timeout``."""
        where = f"data frame {seq} at offset {offset}: expected {nbytes} bytes"
        with self._cond:
            def here() -> bool:
                return self.seq == seq and (offset in self._frames if exact else self._within(offset, nbytes))

            arrived = self._cond.wait_for(lambda: here() or self.seq > seq or bool(self.error), timeout=timeout)
            if here():
                got = self._frames[offset] if exact else nbytes
                if got != nbytes:
                    raise DataError(f"{where}, received {got}")
                return self._buf[offset : offset + nbytes]
            if self.seq > seq:
                raise DataError(f"{where}, received none before frames of a later one ({self.seq})")
            torn = self._torn
            if torn is not None and torn[:2] == (seq, offset):
                raise DataError(f"{where}, received {torn[3]} of {torn[2]} ({self.error})")
            if self.error:
                raise DataError(f"{where}, received none: the data connection ended ({self.error})")
            assert not arrived
            raise DataError(f"{where}, received none within {timeout:.1f}s")

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the connection ended (``on_end`` ran); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """End the connection and join the thread (unless called from it). Idempotent."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._sock.close()
