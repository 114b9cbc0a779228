"""The data connection's wire: one long-lived TCP connection per (worker, server process), calls as frames.

A server process serves all its shards behind one data port
(server/datapath/dataconn.py). Each shard's Register gives the worker the port, a
token and the shard's *route* (a number naming the shard within the
process). The worker opens one connection per process (worker/datapath/dataconn.py),
says hello with the token, and from then on its Push and Pull calls to every
shard of that process are frames on it, not gRPC calls:

- control stays in protobuf: a request frame carries the call's
  PushRequests (or its PullRequest) serialized as for gRPC, each prefixed by
  its length (``LEN``);
- bulk bytes do not: a Push's chunks name the segment ``FRAME_SEGMENT`` and
  an offset in the route's *push buffer* on the server; the frame carries
  those bytes after the control, as *extents* (offset, nbytes), each read
  by the server straight into that buffer. A Pull's answer carries the
  weights after its control the same way, read by the worker straight into
  the shard's pull buffer.

Frames, worker to server (``REQUEST``, then ``ctl`` bytes, then
``n_ext`` times ``EXTENT``, then each extent's bytes in order):

- ``PUSH``: a whole Push, answered once it is applied;
- ``PUSH_PART``: one message of a streamed Push (its gradients come while
  the worker computes); ``PUSH_END`` its last, answered;
- ``PULL``: a Pull, answered once the weights it waits for are there
  (by the server thread that made them so: server/parked.py);
- ``PUSH_PULL``: a whole Push and its shard's Pull in one frame (the
  PullRequest first in the control, then the PushRequests): the Push is
  answered as ``PUSH``'s (an answer of kind ``PUSH``), and once it is taken
  in, the Pull, from the version that answer names (its
  ``ready_version``), is answered as ``PULL``'s (an answer of kind
  ``PUSH_PULL``, the same call). A refused Push's Pull is answered with
  the status ``NOT_MADE`` (no gRPC code): nothing was pulled, the worker
  pulls once its Push is taken in. A step's pull then costs no frame and
  no parse of its own.

Server to worker (``ANSWER``, then ``ctl``, then ``payload`` bytes): the
call's status (``OK`` or a gRPC status code's value, the control then the
message, UTF-8), a PushResponse, or the PullResponses (``LEN``-prefixed)
and the weights they name.

With TLS (the gRPC port's certificates: ``Security.server_ssl_context``,
``client_ssl_context``) the connection is TLS from its first byte, mutual
where the servers require client certificates; the hello and everything
after it are inside.

Limits (``MAX_CTL``, ``MAX_EXTENTS``, ``MAX_BUFFER``) bound what a frame may
make the other end allocate or read. A frame that breaks the protocol (its
magic, a limit, an extent outside the buffer it names) ends the connection:
everything in flight on it fails UNAVAILABLE, and the worker's calls go on
over gRPC. A frame that keeps the protocol but is wrong (an unknown tensor,
a part that was not sent, a worker id not the hello's) is answered with
its status, and nothing is applied.
"""

from __future__ import annotations

import collections
import functools
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

HELLO = struct.Struct("!4s16sqd")  # b"SPC1", token, worker id, deadline (s) of every read and write
ACK = struct.Struct("!4sI")  # b"SPK1", 0
REQUEST = struct.Struct("!4sB3xQIIIIQ")  # magic, kind, call, route, timeout (ms), ctl bytes, extents, buffer bytes
EXTENT = struct.Struct("!QQ")  # offset in the route's buffer, nbytes
ANSWER = struct.Struct("!4sB3xQIIQ")  # magic, kind, call, status, ctl bytes, payload bytes
LEN = struct.Struct("!I")
HELLO_MAGIC, ACK_MAGIC, REQUEST_MAGIC, ANSWER_MAGIC = b"SPC1", b"SPK1", b"SPQ1", b"SPW1"

PUSH, PUSH_PART, PUSH_END, PULL, PING, PUSH_PULL = 1, 2, 3, 4, 5, 6
KINDS = {PUSH: "push", PUSH_PART: "push part", PUSH_END: "push end", PULL: "pull", PING: "ping",
         PUSH_PULL: "push and pull"}
# PING (call 0, nothing after the head): answered at once by the server's reading thread, so a worker whose calls
# wait learns that the server process still runs (worker/datapath/dataconn.py, DataConn._watch)
OK = 0
NOT_MADE = 255  # an answer's status: a PUSH_PULL's Pull that was not made (its Push was refused)

FRAME_SEGMENT = "frame"  # what a chunk whose bytes travel in its frame names as its segment
MAX_CTL = 256 << 20  # control bytes of one frame (compressed chunks carry their bytes in it)
MAX_EXTENTS = 1 << 16
MAX_BUFFER = 1 << 40  # a route's push or pull buffer (reserved lazily, page by page)


class ProtocolError(ValueError):
    """A frame that breaks the protocol: the connection ends."""


class Torn(Exception):
    """The peer ended or stalled past the deadline before a whole read; ``got`` bytes had come."""

    def __init__(self, got: int, why: str) -> None:
        super().__init__(why)
        self.got, self.why = got, why


def tune(sock: socket.socket, timeout: float) -> None:
    """No Nagle delay, and a deadline on every blocking call. The buffers are left to the kernel's
    autotuning: fixed large ones let every connection put megabytes into a shaped link's queue at once
    (docs/history/performance-log.md, "The TCP bulk path on the cluster")."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)


def keep_alive(sock: socket.socket, seconds: float) -> None:
    """The kernel's keepalive as a gRPC channel's (protos/security.py ``KEEPALIVE_S``): after ``seconds``
    without a byte, a probe; no answer within half of that (or data unacknowledged that long past
    ``seconds``) and the connection fails, so a call waiting on a link gone silent ends UNAVAILABLE, not at
    its deadline. 0: none."""
    if seconds <= 0:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", max(1, round(seconds))), ("TCP_KEEPINTVL", max(1, round(seconds / 2))),
                       ("TCP_KEEPCNT", 1), ("TCP_USER_TIMEOUT", max(1, int(1500 * seconds)))):
        if hasattr(socket, opt):  # Linux; elsewhere the deadlines alone end such a call
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def deadlines_in_kernel(sock: socket.socket, timeout: float) -> None:
    """Keep a connected plain socket's deadline in the kernel (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) and its
    descriptor blocking, instead of Python's ``settimeout`` (a non-blocking descriptor, polled before each
    call). ``fill`` then reads a whole part in one call (``MSG_WAITALL``): the kernel copies the packets in
    as the link delivers them, where a non-blocking read returns to the interpreter for each few (1.8x the
    receive calls at 200 Mbit/s than at 10 Gbit/s: docs/performance.md). A TLS socket keeps Python's
    deadline (its reads go through the SSL object)."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(timeout)
        return
    sock.settimeout(None)
    whole = int(timeout)
    tv = struct.pack("ll", whole, int((timeout - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def fill(sock: socket.socket, view: memoryview, idle: Callable[[], bool] | None = None) -> None:
    """Read exactly ``len(view)`` bytes into ``view`` (``recv_into``: no copy, the interpreter's lock
    released while the kernel copies; on a blocking descriptor, ``deadlines_in_kernel``, in one call
    where the deadline allows); ``Torn`` when the peer ends or stalls past the socket's deadline first.
    ``idle``: while nothing at all was read, a timeout only asks it whether to go on waiting (an idle
    connection)."""
    flags = socket.MSG_WAITALL if sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket) else 0
    n = 0
    while n < len(view):
        try:
            k = sock.recv_into(view[n:], 0, flags)
        except (TimeoutError, BlockingIOError):  # Python's deadline, or the kernel's (EAGAIN)
            if n == 0 and idle is not None and idle():
                continue
            raise Torn(n, "stalled past the deadline") from None
        except OSError as e:
            raise Torn(n, f"connection failed ({e.strerror or e})") from None
        if k == 0:
            raise Torn(n, "connection closed")
        n += k


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a frame for no one: a stopped shard's, a call that gave up)."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        k = min(nbytes, len(scratch))
        fill(sock, scratch[:k])
        nbytes -= k


def end(sock: socket.socket, reader: threading.Thread) -> None:
    """End a connection: shut it (its ``reader`` wakes and ends), join that thread unless this is it, close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if reader.is_alive() and reader is not threading.current_thread():
        reader.join()
    sock.close()


def read_exact(sock: socket.socket, nbytes: int) -> bytearray:
    out = bytearray(nbytes)
    if nbytes:
        fill(sock, memoryview(out))
    return out


def send(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """``parts`` in one ``sendmsg`` where the kernel takes them all (straight from their memory: no copy,
    the interpreter's lock released); what it did not take, sent after."""
    views = _views(parts)
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg under TLS: each part encrypted from its memory
        for v in views:
            sock.sendall(v)
        return
    while views:
        n = sock.sendmsg(views[:512])
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = memoryview(views[0])[n:]


JOIN_CONTROL = 64 << 10  # a frame's head and control up to this many bytes go out as one buffer


def head_and_control(head: bytes, ctl: Sequence[bytes], nctl: int) -> list[bytes | memoryview]:
    """A frame's head and its control pieces (``nctl`` bytes in all) as the start of its parts: one buffer
    where they are small (a copy of a few hundred bytes costs less than a buffer each to every write),
    else as they are (a compressed push's control carries its values)."""
    if nctl <= JOIN_CONTROL:
        return [b"".join((head, *ctl))]
    return [head, *ctl]


IOV_MAX = 1024  # the most buffers one writev takes (Linux's UIO_MAXIOV)


class Lender(Protocol):
    """Memory a frame's parts are lent from (``Sender.send(lent=)``): read by the writes until the sender says
    ``sent``. Both are called under the sender's lock."""

    def queued(self, detach: Callable[[], None]) -> None:
        """The frame was not written whole: its rest waits for the writer thread, reading the lent memory
        until ``sent``; ``detach()`` (any thread) copies what is left of it, after which nothing reads it."""

    def sent(self) -> None:
        """The frame's writes no longer read the lent memory (written whole, detached, or dropped)."""


class _Queued:
    """A frame in the writer's queue: what is left of it, and the lender of its parts (None once it is not
    read any more)."""

    __slots__ = ("views", "lent")

    def __init__(self, views: list[memoryview | bytes], lent: Lender | None) -> None:
        self.views, self.lent = views, lent

    def release(self) -> None:
        """Under the sender's lock: nothing reads the lent memory any more; its lender is told (once)."""
        lent, self.lent = self.lent, None
        if lent is not None:
            lent.sent()


class Sender:
    """Frames onto one connection, whole and in order, without the caller ever waiting for the peer.

    ``send`` writes what the socket takes at once (``os.writev`` on a
    non-blocking descriptor, ``sendmsg(MSG_DONTWAIT)`` on a blocking one,
    straight from the parts' memory, the interpreter's lock released);
    what it does not take goes, with every
    frame after it, to the connection's writer thread, which sends it as
    the peer reads (within the socket's deadline). A frame sent from a
    reading thread (an answer sent by the thread that applied the step, the
    next push of a window sent by the thread that read the last answer) can
    then never block that reading: two ends whose reading threads both
    waited on a full socket would wait for each other. On a quiet link the
    writer thread is never started: no hand-off between threads.

    The writer thread too writes only what the socket takes at once, under
    the sender's lock, and waits for room (``poll``) outside it: so a frame
    whose parts are *lent* (``send(lent=)``: a Pull's answer sent from the
    weights themselves, no copy) can be *detached* between two writes, its
    rest copied, before the lender changes that memory (a step on the
    weights: server/datapath/reader.py ``Lent``).

    Under TLS every frame goes through the writer thread (the SSL object
    cannot write part of a record without blocking), written outside the
    lock: a lent frame's parts are copied before it is queued.

    The parts must stay unchanged until the call they belong to is answered
    (the peer has then read them all), or, lent, until ``sent``. A failed
    write ends the connection (``on_error``: the reading thread then ends
    every call in flight). Thread-safety: ``send`` may be called from any
    thread.
    """

    def __init__(self, sock: socket.socket, name: str, on_error: Callable[[str], None]) -> None:
        self._sock, self._name, self._on_error = sock, name, on_error
        # A frame is written by its caller only where a write cannot block: os.writev on the non-blocking
        # descriptor of a socket with Python's deadline, sendmsg(MSG_DONTWAIT) on a blocking one.
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._blocking = sock.gettimeout() is None
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Queued] = collections.deque()  # head: being written
        self._writer: threading.Thread | None = None
        self.error = ""
        self.closed = False
        self.inline_frames = 0  # written whole by the caller
        self.queued_frames = 0  # handed (in part) to the writer thread
        self.detached_frames = 0  # lent frames whose rest was copied before the lender changed its memory

    def send(self, parts: Sequence[bytes | memoryview], lent: Lender | None = None) -> None:
        """One frame (OSError once the connection failed: nothing of it was sent). ``lent``: its parts are
        lent (``Lender``), read until ``lent.sent()``, which comes before this returns where the socket took
        the frame whole."""
        views = _views(parts)
        with self._cv:
            if self.error or self.closed:
                raise OSError(self.error or "connection closed")
            if not self._queue and not self._tls:
                try:
                    views = _write_some(self._sock, views, self._blocking)
                except OSError as e:
                    self._failed(f"send failed: {e.strerror or e}")
                    raise OSError(self.error) from None
                if not views:
                    self.inline_frames += 1
                    if lent is not None:
                        lent.sent()
                    return
            if lent is not None and self._tls:  # the TLS writer writes outside the lock: nothing lent reaches it
                views = _copied(views)
                lent.sent()
                lent = None
            frame = _Queued(views, lent)
            self._queue.append(frame)
            self.queued_frames += 1
            if lent is not None:
                lent.queued(functools.partial(self._detach, frame))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name=f"{self._name}-writer", daemon=True)
                self._writer.start()
            self._cv.notify()

    @property
    def backlogged(self) -> bool:
        """Whether frames wait for the socket to take them (the writer thread's queue is not empty): the peer's
        window, or the link, holds them back. Read without the lock (a snapshot)."""
        return bool(self._queue)

    def _detach(self, frame: _Queued) -> None:
        """Copy what is left of a lent ``frame`` (unless it was sent already): its lender may change the memory
        once this returns. Waits at most for one write that cannot block."""
        with self._cv:
            if frame.lent is None:
                return
            frame.views = _copied(frame.views)
            self.detached_frames += 1
            frame.release()

    def _failed(self, why: str) -> None:
        """Under the lock: the connection failed; what is queued is dropped."""
        if not self.error:
            self.error = why
        self._drop()
        self._cv.notify_all()

    def _drop(self) -> None:
        """Under the lock: the queue emptied, its lenders told."""
        for frame in self._queue:
            frame.release()
        self._queue.clear()

    def _write(self) -> None:
        if self._tls:
            self._write_tls()
            return
        try:
            deadline = _send_deadline(self._sock)
            poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLOUT)
        except (OSError, ValueError) as e:  # the socket closed before this thread began (fileno -1: ValueError)
            with self._cv:
                self._failed(f"send failed: {e}")
                failed = self.error
            self._on_error(failed)
            return
        while True:
            with self._cv:
                frame = self._next_locked()
                if frame is None:
                    return
                try:
                    frame.views = _write_some(self._sock, frame.views, self._blocking)
                except OSError as e:
                    self._failed(f"send failed: {e.strerror or e}")
                    failed = self.error
                else:
                    failed = ""
                    if not frame.views:
                        self._queue.popleft()
                        frame.release()
                        continue
            if failed:
                self._on_error(failed)
                return
            # The socket is full: wait for room outside the lock (a detach may copy the frame's rest meanwhile),
            # looking every half second whether the connection closed.
            if not self._room(poller, deadline):
                return

    def _room(self, poller: select.poll, deadline: float | None) -> bool:
        """The writer thread, outside the lock: wait until the socket takes more; False when the connection
        closed meanwhile, or failed (no room within ``deadline`` seconds: said to ``on_error``)."""
        until = None if deadline is None else time.monotonic() + deadline
        while not poller.poll(500):
            with self._cv:
                if self.closed or self.error:
                    return False
                if until is None or time.monotonic() < until:
                    continue
                self._failed("send failed: stalled past the deadline")
                failed = self.error
            self._on_error(failed)
            return False
        return True

    def _next_locked(self) -> _Queued | None:
        """The writer thread, under the lock: the frame to write next, once there is one; None once the
        connection closed or failed."""
        while not self._queue and not self.closed and not self.error:
            self._cv.wait()
        return None if self.closed or self.error else self._queue[0]

    def _write_tls(self) -> None:
        while True:
            with self._cv:
                frame = self._next_locked()
                if frame is None:
                    return
            try:
                send(self._sock, frame.views)
            except OSError as e:
                with self._cv:
                    self._failed(f"send failed: {e.strerror or e}")
                self._on_error(self.error)
                return
            with self._cv:
                if self._queue:
                    self._queue.popleft()

    def close(self) -> None:
        """No more frames; the writer thread ends (what it still held is dropped) and is joined."""
        with self._cv:
            self.closed = True
            self._cv.notify_all()
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join()
        with self._cv:
            self._drop()


def _copied(views: list[memoryview | bytes]) -> list[memoryview | bytes]:
    """``views`` as bytes of their own (the lent memory may change once this returns)."""
    return [v if type(v) is bytes else bytes(v) for v in views]


def _send_deadline(sock: socket.socket) -> float | None:
    """How long a write may wait for room: Python's deadline, or the kernel's (``SO_SNDTIMEO``); None: no
    deadline."""
    timeout = sock.gettimeout()
    if timeout is not None:
        return timeout
    secs, usecs = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.calcsize("ll")))
    return secs + usecs / 1e6 or None


def _views(parts: Sequence[bytes | memoryview]) -> list[memoryview | bytes]:
    """A frame's non-empty parts as flat byte buffers: ``bytes`` as they are, other buffers as byte views
    (``len`` is then their size in bytes, and a slice cuts bytes)."""
    out: list[memoryview | bytes] = []
    for p in parts:
        if type(p) is not bytes:
            v = memoryview(p)
            p = v if v.format == "B" and v.ndim == 1 else v.cast("B")
        if len(p):
            out.append(p)
    return out


def _write_some(sock: socket.socket, views: list[memoryview | bytes], blocking: bool) -> list[memoryview | bytes]:
    """Write ``views`` to ``sock`` until done or the socket is full, never waiting; what is left (a part
    written in part left as a view of its rest). ``blocking``: its descriptor blocks
    (``deadlines_in_kernel``), each write is told not to. A write that takes less than it was given found
    the socket full: the next would only fail, so none is tried."""
    at = 0
    fd = sock.fileno()
    while at < len(views):
        batch = views[at : at + IOV_MAX] if at or len(views) > IOV_MAX else views  # usually one write, whole
        try:
            n = sock.sendmsg(batch, (), socket.MSG_DONTWAIT) if blocking else os.writev(fd, batch)
        except BlockingIOError:
            break
        full = n < sum(map(len, batch))
        if not full and batch is views:
            return []
        while at < len(views) and n >= len(views[at]):
            n -= len(views[at])
            at += 1
        if n:
            views[at] = memoryview(views[at])[n:]
        if full:
            break
    return views[at:]


def joined(messages: Iterable[bytes]) -> list[bytes]:
    """Serialized messages as the control of a frame: each after its ``LEN``."""
    out: list[bytes] = []
    for m in messages:
        out.append(LEN.pack(len(m)))
        out.append(m)
    return out


def split(ctl: bytes | bytearray | memoryview) -> list[bytes]:
    """The messages of a frame's control (``joined``'s inverse); ProtocolError when it is cut short."""
    view = memoryview(ctl)
    out: list[bytes] = []
    at = 0
    while at < len(view):
        if at + LEN.size > len(view):
            raise ProtocolError(f"control of {len(view)} bytes ends inside a message length at {at}")
        (n,) = LEN.unpack_from(view, at)
        at += LEN.size
        if at + n > len(view):
            raise ProtocolError(f"control message at {at - LEN.size} says {n} bytes, {len(view) - at} left")
        out.append(bytes(view[at : at + n]))
        at += n
    return out


def check_extents(extents: Sequence[tuple[int, int]], buffer_bytes: int) -> None:
    """ProtocolError unless every extent lies inside a buffer of ``buffer_bytes``."""
    for offset, nbytes in extents:
        if offset + nbytes > buffer_bytes:
            raise ProtocolError(f"extent [{offset}, {offset + nbytes}) outside the {buffer_bytes}-byte buffer "
                                f"the frame names")
