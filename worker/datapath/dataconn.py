"""The worker's data connections (protos/dataconn.py): one per server process, every shard's calls as frames.

``DataConn`` is one long-lived connection to a server process's data port,
shared by every shard of that process this worker reaches; ``ConnPath`` is
a ``ShardPath`` (worker/datapath/paths.py) for one shard on it. Its Push and Pull
calls (``Transport.push``/``pull`` with ``via=`` the path) become frames:

- a push's parts go from the gradient's own memory (already in its push
  dtype: this path does not write ahead) as the frame's extents, at each
  part's offset in the shard's push buffer; the control messages name the
  segment ``FRAME_SEGMENT``; the frame is answered with the PushResponse;
- a streamed push (its gradients come while backward runs) is one frame
  per message, the last one ``PUSH_END``;
- a pull's answer brings the weights after its control, read by the
  connection's thread straight into the shard's pull buffer; ``read`` gives
  views of it;
- a step's pull may ride its push's frame (``push_soon(carry=)``,
  ``PUSH_PULL``): two answers on one call number, the push's and, once the
  server took the push in and the weights of the version it named are
  there, the pull's (``NotMade`` where the push was refused).

``ShmConnPath`` is a shard on this machine: its bytes in shared memory
(worker/datapath/paths.py ``ShmPath``), its calls the same frames with no extents (a push's messages
name its push segment, written before the frame goes; a pull's answer says
where in its pull segment the shard wrote the weights). Its pull does not
ride its push (the server makes a carried pull only into the frame's bytes).

One thread per connection reads the answers. A call made by the
transport (``ConnPath.push``/``pull``: a retry, a streamed push) waits for
its answer with its deadline; a call that waits for nothing
(``ConnPath.push_soon``/``pull_soon``: a step's pushes and pulls, see
worker/datapath/pushorder.py and worker/datapath/pull.py) is ended by the reading thread
itself, which runs its completion (a pull's parts are read straight into
their destinations first), or at its deadline by the connection's
``Deadlines`` thread (DEADLINE_EXCEEDED). Frames go out through the
connection's ``Sender`` (protos/dataconn.py): written by the caller as far
as the socket takes them, so that a completion that sends (the next push of
a window) never waits on the server. Should the connection
end (the process went, a broken frame), every call in flight on it fails
UNAVAILABLE (``FrameError``, which the transport reads as it reads a gRPC
error: it retries), and the shards' calls wait for it to be made again
(``ShardPaths.ready``). ``close`` ends the connection and joins its thread.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import logging
import mmap
import socket
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import torch

from shardps.protos import codec, framing
from shardps.protos import dataconn as wire
from shardps.protos.deadlines import Deadlines
from shardps.protos.security import Security, keepalive_seconds
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath.paths import (
    ClientRoute,
    Flat,
    Frames,
    ShmPath,
    SliceRun,
    Staged,
    cast_values,
    slice_chunk,
    slice_places,
)
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.reach import StatusError
from shardps.worker.datapath.shm import ShmLink, part_places
from shardps.worker.layout import Layout

log = logging.getLogger("shardps.worker")


FrameError = StatusError  # a failed call on a data connection, as the transport reads a gRPC error


class ConnectFailed(OSError):
    """A data connection could not be made (refused, no answer, a hello not acknowledged): why."""


class NotMade(StatusError):
    """A Pull carried by its Push's frame (``ConnPath.push_soon(carry=)``) that the server did not make: the
    Push was refused. Nothing was pulled; the Pull is made once the Push is taken in."""


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


Place = Callable[[str, int, int, int], "torch.Tensor | None"]
"""Where a pulled part may land: (tensor, first element, wire dtype, bytes) -> a flat tensor of exactly those
bytes (the destination's own storage), or None: into the shard's pull buffer."""


EXPIRED = -2  # a call's status once its deadline passed unanswered (``DataConn.submit``)


class _Call:
    """One call in flight: waited for (``done``), or ended by ``then`` in the reading thread (or at its
    ``deadline`` by the connection's ``Deadlines``: ``expire``)."""

    __slots__ = ("waiter", "then", "status", "ctl", "nbytes", "into", "place", "parsed", "landed", "deadline",
                 "expire")

    def __init__(self, into: memoryview | None, place: Place | None = None,
                 then: Callable[[_Call], None] | None = None) -> None:
        self.waiter = threading.Event() if then is None else None
        self.then = then
        self.deadline = 0.0
        self.expire: Callable[[], None] = _nothing
        self.status, self.ctl, self.nbytes, self.into, self.place = -1, b"", 0, into, place
        self.parsed: list[Any] | None = None  # a placed Pull's messages, parsed by the reading thread
        self.landed: dict[int, torch.Tensor] = {}  # answer offset -> the destination its bytes were read into

    @property
    def done(self) -> bool:
        """A call that waits for nothing: answered, failed or given up (``Deadlines`` then drops it)."""
        return self.then is None and self.waiter is None

    def end(self) -> None:
        """The answer is in (or the connection ended: status -1): wake the waiter, or run ``then``. Its bytes
        are read by now: where they went is not kept (a call done early stays in the connection's
        ``Deadlines`` until its deadline, and ``place`` holds the pull and its destinations)."""
        self.into = self.place = None
        if self.then is None:
            if self.waiter is not None:
                self.waiter.set()
            return
        then, self.then = self.then, None  # once
        try:
            then(self)
        except Exception:  # noqa: BLE001 - the reading thread goes on; the call's owner failed on its own
            log.exception("a data connection call's completion failed")


def _nothing() -> None:
    pass


def moved(sock: socket.socket) -> tuple[int, int, int] | None:
    """What the kernel says of a connection's bytes so far: received, acknowledged by the peer, and queued
    to send (sent but not acknowledged, or not sent yet); None where it does not say (not Linux, a kernel
    before 4.1, a closed socket). ``TCP_INFO``'s ``tcpi_bytes_received`` and ``tcpi_bytes_acked``, and
    ``SIOCOUTQ``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return None
    if len(info) < _TCP_INFO_BYTES:
        return None
    acked, received = struct.unpack_from("=QQ", info, 120)
    return received, acked, queued


_TCP_INFO_BYTES = 136  # Linux's struct tcp_info up to tcpi_bytes_received (offsets 120: bytes_acked, 128: received)
BACKLOG_BYTES = 64 << 10  # bytes waiting in the kernel to be acknowledged that make a backlog (a ping is 40)


class DataConn:
    """One connection to a server process's data port (module docstring)."""

    def __init__(self, sock: socket.socket, where: str, on_end: Callable[[str], None], timeout: float) -> None:
        self.sock, self.where, self._on_end = sock, where, on_end
        self.timeout = timeout
        self.sender = wire.Sender(sock, f"shardps-data-{where}", self.close_after_failure)
        self._mu = threading.Lock()
        self._reading = threading.Lock()  # held while an answer is read into its call's destinations
        self._deadlines: Deadlines | None = None  # of the calls that wait for nothing (made on the first)
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self.error = ""  # why the connection ended ('' while it serves)
        self.closed = False
        self.token, self.worker_id = b"", -1
        self._thread = threading.Thread(target=self._run, name=f"shardps-data-{where}", daemon=True)
        self.keepalive = keepalive_seconds()
        self._heard_at = time.monotonic()  # the last answer frame (or the first call after none waited)
        self._ping_at = 0.0  # when the ping not answered yet went (0: none)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @staticmethod
    def open(host: str, port: int, token: bytes, worker_id: int, timeout: float,
             on_end: Callable[[str], None], security: Security | None = None) -> DataConn:
        """Connect (with ``security``'s TLS, if any), say hello, wait for the ACK (all within ``timeout``);
        ``ConnectFailed`` saying why when that fails."""
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host.strip("[]"), port), timeout=timeout)
        except OSError as e:
            raise ConnectFailed(f"no data connection to {where}: {e}") from None
        try:
            wire.tune(sock, timeout)
            wire.keep_alive(sock, keepalive_seconds())
            tls = security.client_ssl_context() if security is not None else None
            if tls is not None:
                name = security.server_name if security is not None and security.server_name else host.strip("[]")
                sock = tls.wrap_socket(sock, server_hostname=name)
            sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, token, worker_id, timeout))
            ack = wire.read_exact(sock, wire.ACK.size)
            if wire.ACK.unpack(ack) != (wire.ACK_MAGIC, 0):
                raise OSError("the server did not acknowledge")
            wire.deadlines_in_kernel(sock, timeout)
        except (OSError, wire.Torn) as e:
            sock.close()
            raise ConnectFailed(f"data connection to {where} refused: {e}") from None
        conn = DataConn(sock, where, on_end, timeout)
        conn.token, conn.worker_id = token, worker_id  # what a second connection of this worker would say
        conn._thread.start()
        if conn.keepalive > 0:
            conn._watcher = threading.Thread(target=conn._watch, name=f"shardps-data-ping-{where}", daemon=True)
            conn._watcher.start()
        return conn

    def _watch(self) -> None:
        """While calls wait: a PING once ``keepalive`` seconds passed without an answer frame and without bytes
        moving; none back within half of that, and no bytes moved meanwhile, and the connection ends (its
        calls fail UNAVAILABLE: retried, and failed over, as gRPC's would be). A server process that stopped
        (SIGSTOP, a long pause) answers nothing though its kernel keeps the TCP connection, and the kernel's
        keepalive sees nothing wrong: this does.

        A long frame on a slow link is not silence, though its answer, or the ping's, waits behind it: bytes
        moving are the kernel's counts (``moved``). Bytes received move (a stopped server's kernel sends what
        it holds, a few MB, and nothing after). Bytes the server acknowledged move only while this end had a
        backlog at both looks (frames waiting in the sender, or ``BACKLOG_BYTES`` in the kernel): a stopped
        server's kernel takes data only until its receive buffer is full, and a backlog fills it at the link's
        rate, where frames sent one by one would keep a stopped server's connection open for as long as they
        came (under TLS each frame waits in the sender a moment: a look may find one, two in a row rarely)."""
        k = self.keepalive
        counts = moved(self.sock)
        backlog = False
        moved_at = 0.0
        while not self._stop.wait(k / 4):
            seen = moved(self.sock)
            now = time.monotonic()
            was, backlog = backlog, self.sender.backlogged or (seen is not None and seen[2] >= BACKLOG_BYTES)
            if seen is not None and counts is not None and (
                    seen[0] > counts[0] or was and backlog and seen[1] > counts[1]):
                moved_at = now
            counts = seen
            ping_at = self._ping_at  # (read once: the reading thread clears it as the answer comes)
            if ping_at:
                if now - max(ping_at, moved_at) >= k / 2:
                    self.close_after_failure(f"the server answered no ping within {k / 2:g}s (stopped?)")
                    return
                continue
            with self._mu:
                waiting = bool(self._calls)
            if waiting and now - max(self._heard_at, moved_at) >= k:
                self._ping_at = now
                try:
                    self.sender.send([wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PING, 0, 0, 1, 0, 0, 0)])
                except OSError:
                    return  # the connection ended: the reading thread says why

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # this thread only copies answers into tensors (the mode is per thread)
        head = bytearray(wire.ANSWER.size)
        head_view = memoryview(head)
        why = ""
        current: _Call | None = None  # the call whose answer is being read (its waiter waits for it)

        def idle() -> bool:
            return not self.closed

        try:
            while True:
                wire.fill(self.sock, head_view, idle=idle)
                self._heard_at, self._ping_at = time.monotonic(), 0.0
                magic, kind, call, status, nctl, nbytes = wire.ANSWER.unpack(head)
                if magic != wire.ANSWER_MAGIC or nctl > wire.MAX_CTL or nbytes > wire.MAX_BUFFER:
                    raise wire.ProtocolError(f"not an answer frame (starts {bytes(magic)!r}, {nctl} control "
                                             f"bytes, {nbytes} payload bytes)")
                ctl = wire.read_exact(self.sock, nctl)
                key = -call if kind == wire.PUSH_PULL else call  # a Push's carried Pull (``submit(carry=)``)
                with self._reading:
                    with self._mu:
                        c = self._calls.pop(key, None)
                    current = c
                    into = c.into if c is not None else None
                    if nbytes and (into is None or nbytes > len(into)):
                        if c is not None:
                            raise wire.ProtocolError(f"call {call}: an answer of {nbytes} bytes for a buffer of "
                                                     f"{len(into) if into is not None else 0}")
                        wire.discard(self.sock, nbytes)  # a call that gave up (its deadline passed)
                        continue
                    if c is not None:
                        c.status, c.ctl, c.nbytes = status, bytes(ctl), nbytes
                        if c.place is not None and status == wire.OK:
                            self._placed(c, nbytes)
                        elif nbytes and into is not None:
                            wire.fill(self.sock, into[:nbytes])
                if c is not None:
                    current = None
                    c.end()
                    c = None  # not kept while the next answer is awaited (its parts' destinations with it)
        except wire.Torn as t:
            why = "" if self.closed else t.why
        except wire.ProtocolError as e:
            why = f"protocol error: {e}"
        except Exception as e:  # noqa: BLE001 - whatever ends the reading ends the connection, said below
            why = f"{type(e).__name__}: {e}"
        finally:
            self.error = self.error or why or "closed"  # a failure said first (a ping not answered) stays
            self._stop.set()
            with self._mu:
                pending, self._calls = list(self._calls.values()), {}
            if current is not None:
                current.status = -1
                pending.append(current)
            self.close_after_failure(self.error)  # the writer thread, should it wait on the socket, ends too
            self.sender.close()
            for c in pending:
                c.end()  # status -1: the connection ended
            if not self.closed:
                self._on_end(self.error)

    def _placed(self, c: _Call, nbytes: int) -> None:
        """A Pull's answer: its messages parsed here, and each part's bytes read straight into the
        destination ``c.place`` gives for it (the parameter's own storage, where its dtype is the wire's),
        the others into the call's buffer at their offsets."""
        assert c.place is not None and c.into is not None
        c.parsed = [framing.read_pull_response(m) for m in wire.split(c.ctl)]
        regions = []
        for resp in c.parsed:
            ch = resp.chunk
            if ch.shm_bytes:
                if ch.shm_offset < 0 or ch.shm_offset + ch.shm_bytes > nbytes:
                    raise wire.ProtocolError(f"tensor {ch.name!r}: bytes [{ch.shm_offset}, "
                                             f"{ch.shm_offset + ch.shm_bytes}) outside the {nbytes}-byte answer")
                regions.append((ch.shm_offset, ch.shm_bytes, c.place(ch.name, ch.offset, ch.dtype, ch.shm_bytes)))
        regions.sort(key=lambda r: r[0])
        at = 0
        for off, n, target in regions:
            if off < at:
                raise wire.ProtocolError(f"an answer's parts overlap at byte {off}")
            if off > at:  # alignment between parts
                wire.fill(self.sock, c.into[at:off])
            if target is not None:
                wire.fill(self.sock, _bytes(target))
                c.landed[off] = target
            else:
                wire.fill(self.sock, c.into[off : off + n])
            at = off + n
        if at < nbytes:
            wire.fill(self.sock, c.into[at:nbytes])

    def _unavailable(self) -> FrameError:
        return FrameError(grpc.StatusCode.UNAVAILABLE, f"data connection to {self.where} ended ({self.error})")

    def _send(self, kind: int, call: int, route: int, ctl: Sequence[bytes], extents: Sequence[tuple[int, Any]],
              buffer_bytes: int, timeout: float) -> None:
        """The request frame (``wire.Sender``: written by this thread as far as the socket takes it, the rest by
        the connection's writer thread; never waits for the server)."""
        nctl = sum(map(len, ctl))
        head = wire.REQUEST.pack(wire.REQUEST_MAGIC, kind, call, route, max(1, int(timeout * 1000)), nctl,
                                 len(extents), buffer_bytes)
        frame = wire.head_and_control(head, [*ctl, *(wire.EXTENT.pack(o, len(v)) for o, v in extents)],
                                      nctl + wire.EXTENT.size * len(extents))
        frame.extend(v for _, v in extents)
        try:
            if self.error:
                raise OSError(self.error)
            self.sender.send(frame)
        except OSError as e:
            with self._mu:
                mine = self._calls.pop(call, None)
                carried = self._calls.pop(-call, None)
            self.close_after_failure(f"send failed: {e}")
            if mine is None:
                # Ended meanwhile by the connection's end (its reading thread ends every call it holds, running
                # ``then``: UNAVAILABLE) or by its deadline: its ``then`` says so. Raising too would have the
                # caller make the call again beside the retry that ``then`` began.
                if carried is not None:
                    carried.status = -1
                    carried.end()
                return
            raise self._unavailable() from None

    def _begin(self, into: memoryview | None, place: Place | None = None,
               then: Callable[[_Call], None] | None = None) -> tuple[int, _Call]:
        call = next(self._ids)
        c = _Call(into, place, then)
        with self._mu:
            if self.error:
                raise self._unavailable()
            if not self._calls:  # an idle connection heard nothing because nothing was asked
                self._heard_at = time.monotonic()
            self._calls[call] = c
        return call, c

    def submit(self, kind: int, route: int, ctl: Sequence[bytes], extents: Sequence[tuple[int, Any]],
               buffer_bytes: int, timeout: float, then: Callable[[_Call], None], *, into: memoryview | None = None,
               place: Place | None = None, carry: _Call | None = None) -> int:
        """A call that waits for nothing: ``then(call)`` runs in the reading thread once its answer is in
        (``result``: its control and payload bytes, or the FrameError) or the connection ended; the call's
        number (``cancel``). FrameError (UNAVAILABLE) when it cannot be sent, ``then`` not run. Each call
        ends by its deadline at the latest (``timeout``: the connection's ``Deadlines``). ``carry``: a
        ``PUSH_PULL``'s Pull, a second call answered on the same number (``-call`` for ``cancel``), ended
        as this one is."""
        call, c = self._begin(into, place, then)
        c.deadline = time.monotonic() + timeout
        c.expire = functools.partial(self._expire, call)
        if carry is not None:
            carry.deadline, carry.expire = c.deadline, functools.partial(self._expire, -call)
            with self._mu:
                self._calls[-call] = carry
        with self._mu:
            if self._deadlines is None:
                self._deadlines = Deadlines(f"shardps-data-deadlines-{self.where}")
            deadlines = self._deadlines
        deadlines.add(c)
        if carry is not None:
            deadlines.add(carry)
        self._send(kind, call, route, ctl, extents, buffer_bytes, timeout)
        return call

    def _expire(self, call: int) -> None:
        """The deadlines' thread: ``call`` got no answer in time; it ends DEADLINE_EXCEEDED (unless its answer
        is being read right now: that ends it)."""
        with self._mu:
            c = self._calls.pop(call, None)
        if c is not None:
            c.status, c.ctl = EXPIRED, b""
            c.end()

    def cancel(self, call: int) -> bool:
        """The caller gives up on ``call``: its answer will be dropped unread, ``then`` never run; if the
        answer is being read right now, this waits for that to end (nothing writes into the call's
        destinations once this returns). False when the call had ended already."""
        with self._mu:
            mine = self._calls.pop(call, None)
        if mine is None:
            with self._reading:  # its answer may be being read: that ends first
                pass
            return False
        mine.then = None
        return True

    def _wait(self, call: int, c: _Call, timeout: float, what: str) -> tuple[bytes, int]:
        assert c.waiter is not None
        if not c.waiter.wait(timeout):
            with self._mu:
                mine = self._calls.pop(call, None)
            if mine is None:  # its answer is being read (maybe into its destinations): that ends first
                c.waiter.wait(self.timeout + 5.0)
            if c.waiter.is_set():  # answered as it gave up
                return self.result(c)
            raise FrameError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what} on {self.where}: no answer within "
                                                                f"{timeout:.1f}s")
        return self.result(c)

    def result(self, c: _Call) -> tuple[bytes, int]:
        """An ended call's answer: its control and payload bytes; FrameError for a failed one (``NotMade``
        for a carried Pull its server did not make)."""
        if c.status == wire.NOT_MADE:
            raise NotMade(grpc.StatusCode.ABORTED, f"{self.where}: {c.ctl.decode(errors='replace')}")
        if c.status == EXPIRED:
            raise FrameError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.where}: no answer within the call's "
                                                                f"deadline")
        if c.status < 0:
            raise self._unavailable()
        if c.status != wire.OK:
            raise FrameError(_BY_VALUE.get(c.status, grpc.StatusCode.UNKNOWN), c.ctl.decode(errors="replace"))
        return c.ctl, c.nbytes

    def call(self, kind: int, route: int, ctl: Sequence[bytes], extents: Sequence[tuple[int, Any]],
             buffer_bytes: int, timeout: float, into: memoryview | None = None) -> tuple[bytes, int]:
        """One call (a whole Push, or a Pull): its answer's control and how many payload bytes came into
        ``into``; FrameError for a failed one."""
        call, c = self._begin(into)
        self._send(kind, call, route, ctl, extents, buffer_bytes, timeout)
        return self._wait(call, c, timeout, wire.KINDS[kind])

    def pull(self, route: int, request: bytes, buffer_bytes: int, timeout: float, into: memoryview,
             place: Place) -> tuple[list[Any], dict[int, torch.Tensor], int]:
        """A Pull whose parts land where ``place`` says (else in ``into``): its PullResponses, the parts that
        landed (by offset in the answer) and the answer's bytes; FrameError for a failed one."""
        call, c = self._begin(into, place)
        self._send(wire.PULL, call, route, (request,), (), buffer_bytes, timeout)
        _, nbytes = self._wait(call, c, timeout, "pull")
        return c.parsed or [], c.landed, nbytes

    def stream(self, route: int, parts: Iterator[tuple[bytes, list[tuple[int, Any]]]], buffer_bytes: int,
               timeout: float) -> bytes:
        """A streamed Push: each (message, its extents) of ``parts`` as a frame as it comes, the last marked;
        the PushResponse's bytes."""
        call, c = self._begin(None)
        try:
            held: tuple[bytes, list[tuple[int, Any]]] | None = None
            for part in parts:
                if held is not None:
                    self._send(wire.PUSH_PART, call, route, wire.joined((held[0],)), held[1], buffer_bytes, timeout)
                held = part
            msg, ext = held if held is not None else (b"", [])
            self._send(wire.PUSH_END, call, route, wire.joined((msg,)) if msg else (), ext, buffer_bytes, timeout)
        except BaseException:
            with self._mu:
                self._calls.pop(call, None)
            raise
        return self._wait(call, c, timeout, "push")[0]

    def malformed(self, why: str) -> FrameError:
        """An answer that does not parse: the connection ends (nothing more read on it is to be trusted) and the
        call fails INTERNAL, as a gRPC answer that does not deserialize does."""
        self.close_after_failure(f"protocol error: {why}")
        return FrameError(grpc.StatusCode.INTERNAL, f"data connection to {self.where}: {why}")

    def close_after_failure(self, why: str) -> None:
        if not self.error:
            self.error = why
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """End the connection and join its threads (unless called from one). Idempotent."""
        self.closed = True
        self._stop.set()
        self.sender.close()
        wire.end(self.sock, self._thread)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)
        with self._mu:
            deadlines, self._deadlines = self._deadlines, None
        if deadlines is not None:
            deadlines.close()


def _bytes(values: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (bf16 too), its storage left resizable (a parameter a
    pull lands in: ``codec.tensor_memory``)."""
    return codec.tensor_memory(values)


class _Framed:
    """A whole push's messages (``ConnPath.push_messages``) with the extents their chunks name, gathered as
    they are made: one call's own, never another's (two calls framed on one path at once, a retry beside a
    push the window started, would otherwise take each other's bytes)."""

    def __init__(self, make: Callable[[list[tuple[int, memoryview]]], Iterator[bytes]]) -> None:
        self.extents: list[tuple[int, memoryview]] = []
        self._it = make(self.extents)

    def __iter__(self) -> _Framed:
        return self

    def __next__(self) -> bytes:
        return next(self._it)


class FrameCalls:
    """A shard's Push calls as frames on its process's ``conn`` (``route``: the shard's number there), shared by
    ``ConnPath`` (the bytes in the frames, as ``_taken`` extents in a push buffer of ``push_bytes``) and
    ``ShmConnPath`` (the bytes in shared memory: no extents)."""

    conn: DataConn
    route: int
    shard: int
    closed: bool
    push_bytes = 0

    def _taken(self) -> list[tuple[int, memoryview]]:
        """The extents of the push being framed (none: its bytes are elsewhere)."""
        return []

    def _extents_of(self, requests: Iterator[bytes]) -> list[tuple[int, memoryview]]:
        """Once ``requests`` are all made: the extents they name (a whole push's own, ``_Framed``'s, or those of
        an iterator that passes a ``_Framed``'s on: its ``extents``), else those framed on this path since its
        call began (``_taken``)."""
        extents: list[tuple[int, memoryview]] | None = getattr(requests, "extents", None)
        return extents if extents is not None else self._taken()

    def _closed(self) -> FrameError:
        return FrameError(grpc.StatusCode.UNAVAILABLE, f"shard {self.shard}: its data path was closed "
                                                       "(a fail-over, a lost connection): asked again on the "
                                                       "path it has now")

    def push(self, requests: Iterator[bytes], timeout: float, *, stream: bool = False) -> ps_pb2.PushResponse:
        if self.closed:
            raise self._closed()
        if stream:
            parts = ((m, self._taken()) for m in requests)
            return ps_pb2.PushResponse.FromString(self.conn.stream(self.route, parts, self.push_bytes, timeout))
        messages = list(requests)
        ctl, _ = self.conn.call(wire.PUSH, self.route, wire.joined(messages), self._extents_of(requests),
                                self.push_bytes, timeout)
        return ps_pb2.PushResponse.FromString(ctl)

    def _pushed(self, then: Callable[[ps_pb2.PushResponse | None, FrameError | None], None]
                ) -> Callable[[_Call], None]:
        """A ``push_soon``'s completion: its answer, or its failure, handed to ``then``."""
        def done(c: _Call) -> None:
            try:
                ctl, _ = self.conn.result(c)
                answer = ps_pb2.PushResponse.FromString(ctl)
            except FrameError as e:
                then(None, e)
                return
            except Exception as e:  # noqa: BLE001 - an answer that does not parse: the connection is not to be trusted
                then(None, self.conn.malformed(f"a Push's answer does not parse: {e}"))
                return
            then(answer, None)

        return done


class ConnPath(FrameCalls):
    """One shard's calls as frames on its process's ``conn`` (module docstring)."""

    writes_ahead = False
    carries = True  # a step's Pull may ride its Push's frame (``push_soon(carry=)``)

    def __init__(self, conn: DataConn, route: int, shard: int, smap: ShardMap,
                 layouts: Mapping[str, Layout]) -> None:
        self.conn, self.route, self.shard = conn, route, shard
        self.calls: ConnPath | None = self
        self.offsets, self.push_bytes, self.pull_bytes = part_places(shard, smap, layouts)  # as ShmLink's segments
        # Room for an answer of every part, mapped, not filled: a page is the worker's only once a pull's bytes
        # are read into it (a part that does not land in its parameter), where a buffer of zeros would hold the
        # model's size from the start, the streamed worker's too.
        self._pull_buf = mmap.mmap(-1, max(1, self.pull_bytes))
        self._pulled = 0  # bytes of the latest pull's answer
        self._landed: dict[int, torch.Tensor] = {}  # its parts read into their destinations, by answer offset
        self._extents: list[tuple[int, memoryview]] = []
        self.closed = False

    @property
    def push_segment(self) -> str:
        """What a push's chunks name; read as each call starts (its parts so far are dropped)."""
        self._extents = []
        return wire.FRAME_SEGMENT

    def take_pull(self, nbytes: int) -> str:
        return wire.FRAME_SEGMENT

    def stage(self, flats: Mapping[str, torch.Tensor], parts: Sequence[tuple[str, int, int]] | None = None
              ) -> Staged | None:
        return None

    def read_values(self, staged: Staged | None, flats: Mapping[str, torch.Tensor], cast: set[str],
                    route: ClientRoute) -> list[torch.Tensor]:
        return cast_values(self.shard, flats, cast, route)

    def _part(self, name: str, flat: Flat, start: int, stop: int, route: ClientRoute,
              cast: bool, extents: list[tuple[int, memoryview]] | None = None) -> ps_pb2.Chunk:
        """One part as an extent of the call's frame (added to ``extents``, the call's own, else to this path's
        streamed push); the chunk that names it."""
        lay = route.layouts[name]
        values = flat[start:stop]
        if cast:  # meant for shared memory (a fail-over): cast here
            values = values.to(codec.to_torch_dtype(lay.push_dtype))
        off = self.offsets[(name, start)]
        if values.numel():  # an empty part has no bytes (the shard reads none for it)
            (self._extents if extents is None else extents).append((off, _bytes(values.contiguous())))
        return ps_pb2.Chunk(name=name, offset=start, dtype=lay.push_dtype, shape=lay.shape,  # type: ignore[arg-type]
                            shm_offset=off, shm_bytes=values.numel() * values.element_size())

    def push_messages(self, frames: Frames, staged: Staged | None, flats: Mapping[str, torch.Tensor],
                      cast: set[str], route: ClientRoute) -> Iterator[bytes]:
        framer = frames(wire.FRAME_SEGMENT)
        assert route.shard_map is not None
        parts = route.shard_map.parts_for(self.shard)

        def messages(extents: list[tuple[int, memoryview]]) -> Iterator[bytes]:
            chunks = [self._part(p.name, flats[p.name], p.start, p.stop, route, p.name in cast, extents)
                      for p in parts if p.name in flats]
            yield from framer.shm_chunks(chunks, last=True)

        return _Framed(messages)

    def bucket_messages(self, frames: PushFramer, batch: Sequence[tuple[str, Flat]],
                        written: Mapping[str, Mapping[int, Sequence[ps_pb2.Chunk]]],
                        ranges: Mapping[str, Sequence[tuple[int, int]]], route: ClientRoute) -> Iterator[bytes]:
        chunks = [self._part(name, flat, start, stop, route, name in written)
                  for name, flat in batch for start, stop in ranges.get(name, ())]
        if chunks:
            yield from frames.shm_chunks(chunks, last=False)

    def slice_messages(self, frames: Frames, runs: Sequence[SliceRun], chunk_bytes: int) -> Iterator[bytes]:
        framer = frames(wire.FRAME_SEGMENT)

        def messages(extents: list[tuple[int, memoryview]]) -> Iterator[bytes]:
            chunks = []
            for r, off in zip(runs, slice_places(runs, self.offsets), strict=True):
                c = slice_chunk(r, off)
                if c.shm_bytes:  # sent from the slice's own memory
                    extents.append((off, _bytes(r.flat[r.at : r.at + r.n])))
                chunks.append(c)
            yield from framer.shm_chunks(chunks, last=True)

        return _Framed(messages)

    def _taken(self) -> list[tuple[int, memoryview]]:
        out, self._extents = self._extents, []
        return out

    # -- the calls (Transport.push / pull with via=this path; push: FrameCalls.push) ---------------------

    def pull(self, request: ps_pb2.PullRequest, timeout: float, place: Place | None = None) -> Iterator[Any]:
        if self.closed:
            raise self._closed()
        into = memoryview(self._pull_buf)
        data = request.SerializeToString()
        if place is None:
            ctl, self._pulled = self.conn.call(wire.PULL, self.route, (data,), (), self.pull_bytes, timeout, into=into)
            self._landed = {}
            return iter([framing.read_pull_response(m) for m in wire.split(ctl)])
        messages, self._landed, self._pulled = self.conn.pull(self.route, data, self.pull_bytes, timeout, into, place)
        return iter(messages)

    def push_soon(self, requests: Iterator[bytes], timeout: float,
                  then: Callable[[ps_pb2.PushResponse | None, FrameError | None], None],
                  carry: tuple[ps_pb2.PullRequest, Place, Callable[[list[Any] | None, FrameError | None], None]]
                  | None = None) -> int:
        """A whole push that waits for nothing (``DataConn.submit``): ``then(answer, None)`` or ``then(None,
        error)`` in the connection's reading thread; the call's number (``DataConn.cancel``). ``carry``:
        the shard's Pull (its request, where its parts land, its ``then`` as ``pull_soon``'s) in the same
        frame (``PUSH_PULL``), made by the server from the version the push's answer names; ``-number``
        cancels it. Its ``then`` gets ``NotMade`` when the push was refused."""
        if self.closed:
            raise self._closed()
        done = self._pushed(then)
        messages = list(requests)
        if carry is None:
            return self.conn.submit(wire.PUSH, self.route, wire.joined(messages), self._extents_of(requests),
                                    self.push_bytes, timeout, done)
        request, place, pulled = carry
        request.frame_bytes = self.pull_bytes
        carried = _Call(memoryview(self._pull_buf), place, functools.partial(self._pulled_soon, pulled))
        return self.conn.submit(wire.PUSH_PULL, self.route, wire.joined([request.SerializeToString(), *messages]),
                                self._extents_of(requests), self.push_bytes, timeout, done, carry=carried)

    def _pulled_soon(self, then: Callable[[list[Any] | None, FrameError | None], None], c: _Call) -> None:
        """A framed Pull's answer (``pull_soon``, a carried one): ``read`` reads it from now on."""
        try:
            _, nbytes = self.conn.result(c)
        except FrameError as e:
            then(None, e)
            return
        self._landed, self._pulled = c.landed, nbytes
        then(c.parsed or [], None)

    def pull_soon(self, request: ps_pb2.PullRequest, timeout: float, place: Place,
                  then: Callable[[list[Any] | None, FrameError | None], None]) -> int:
        """A pull that waits for nothing, its parts landing where ``place`` says: ``then(responses, None)`` or
        ``then(None, error)`` in the connection's reading thread, with ``read`` reading this answer then;
        the call's number (``DataConn.cancel``)."""
        if self.closed:
            raise self._closed()
        return self.conn.submit(wire.PULL, self.route, (request.SerializeToString(),), (), self.pull_bytes, timeout,
                                functools.partial(self._pulled_soon, then), into=memoryview(self._pull_buf),
                                place=place)

    def read(self, chunk: ps_pb2.Chunk, segment: str) -> torch.Tensor:
        if not chunk.shm_bytes:
            return codec.decode(chunk.data, chunk.dtype)
        landed = self._landed.pop(chunk.shm_offset, None)  # read once: the destination is not kept after
        if landed is not None:  # read straight into its destination: nothing left to copy
            return landed
        if chunk.shm_offset < 0 or chunk.shm_offset + chunk.shm_bytes > self._pulled:
            raise ValueError(f"shard {self.shard}, tensor {chunk.name!r}: bytes [{chunk.shm_offset}, "
                             f"{chunk.shm_offset + chunk.shm_bytes}) outside the {self._pulled} its answer brought")
        at = chunk.shm_offset
        out: torch.Tensor = codec.decode(memoryview(self._pull_buf)[at : at + chunk.shm_bytes], chunk.dtype)
        return out

    def pulled(self, segment: str) -> None:
        pass

    def unpulled(self, segment: str) -> None:
        pass

    def close(self) -> None:
        """This shard's calls go elsewhere from now on; the connection stays (ShardPaths closes it)."""
        self.closed = True


class ShmConnPath(FrameCalls, ShmPath):
    """A shard on this machine: its bytes in shared memory (``ShmPath``: written ahead into the push segment,
    the weights written by the shard into the pull segment), its Push and Pull calls as frames on this
    worker's connection to the shard's process (no extents: the messages name the segments). No gRPC call
    in a step. Should the connection end, its calls wait for it to be made again (``ShardPaths.ready``),
    when a new path on the same segments takes this one's place."""

    def __init__(self, link: ShmLink, shard: int, conn: DataConn, route: int) -> None:
        super().__init__(link, shard)
        self.conn, self.route = conn, route
        self.calls = self
        self.closed = False

    carries = False  # the server makes a carried Pull only into the frame's bytes

    def pull(self, request: ps_pb2.PullRequest, timeout: float, place: Place | None = None) -> Iterator[Any]:
        if self.closed:
            raise self._closed()
        ctl, _ = self.conn.call(wire.PULL, self.route, (request.SerializeToString(),), (), 0, timeout)
        return iter([framing.read_pull_response(m) for m in wire.split(ctl)])

    def push_soon(self, requests: Iterator[bytes], timeout: float,
                  then: Callable[[ps_pb2.PushResponse | None, FrameError | None], None],
                  carry: Any = None) -> int:
        """``ConnPath.push_soon`` for the segment's bytes; its Pull does not ride it (``carries`` is False)."""
        if self.closed:
            raise self._closed()
        if carry is not None:
            raise ValueError("a Pull through shared memory does not ride its Push's frame")
        return self.conn.submit(wire.PUSH, self.route, wire.joined(list(requests)), (), 0, timeout,
                                self._pushed(then))

    def pull_soon(self, request: ps_pb2.PullRequest, timeout: float, place: Place,
                  then: Callable[[list[Any] | None, FrameError | None], None]) -> int:
        """``ConnPath.pull_soon`` for the pull segment: the answer's messages say where the shard wrote the
        weights (``read`` reads them there); ``place`` is not used (the bytes are in the segment already)."""
        if self.closed:
            raise self._closed()

        def done(c: _Call) -> None:
            try:
                ctl, _ = self.conn.result(c)
                responses = [framing.read_pull_response(m) for m in wire.split(ctl)]
            except FrameError as e:
                then(None, e)
                return
            except Exception as e:  # noqa: BLE001 - an answer that does not parse: the connection is not to be trusted
                then(None, self.conn.malformed(f"a Pull's answer does not parse: {e}"))
                return
            then(responses, None)

        return self.conn.submit(wire.PULL, self.route, (request.SerializeToString(),), (), 0, timeout, done)

    def close(self) -> None:
        """This shard's calls go elsewhere from now on; its segments stay (``ShardPaths`` closes them)."""
        self.closed = True
