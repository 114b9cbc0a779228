"""``SocketLink``: the walker's ``Link`` between pipeline stages on CPU, over one TCP connection per pair of neighbours.

Stage s and stage s + 1 share one connection: forward outputs go up it,
input gradients down it. A value is one frame, a header of ``HEADER_LEN``
int64s (``worker/pipeline/link.py``'s, so shapes and dtypes may change from
one value to the next) and its bytes, written with one ``sendmsg``; the
receiver reads the payload straight into the tensor it returns. When the walk
takes a value, its receiver says so (a header with ``ACK_MAGIC``): the
sender counts the value taken then, and a failure names the last value a
dead neighbour took. These words are held back and go with the next value to
that neighbour or when the stage is about to wait, off its critical path; the
word for a neighbour's last value of the step goes at once (its ``flush``
waits for it). So a stage that dies in the middle of a task may be named
with the value before (``worker/pipeline/failure.py``: "in micro-batch 1 or
after it"). Frames from one neighbour arrive in the order sent, so
the header is also a check (another micro-batch, kind or step: an error that
says both).

The stage's own thread does the work, without blocking on a peer: the
sockets are non-blocking; ``send`` writes what the kernel takes at once (a
whole value, unless it is larger than the connection's buffers), and hands
the rest to the link's writer thread, which writes it as the neighbour reads
(so a stage that goes on computing does not hold its neighbour's value back,
and 1F1B's sends in both directions cannot deadlock); every wait (``recv``,
``flush``) polls both neighbours' connections until what it waits for is
there, reading whatever arrives into the frames it makes (a value is received
ahead, while this stage waits for another). Every wait has the step's deadline; a
neighbour whose process ended is noticed at once (its connection reads end
of file or resets); ``close()`` closes the connections, so that the
neighbours waiting on this stage learn at once that it failed. The errors are
``LinkError``s, as ``GroupLink``'s (which carries values over nccl on GPUs).

Why not gloo on CPU: a gloo send goes only into a posted receive and
completes in gloo's own threads, so each value cost a header, a payload and
an acknowledgement as three messages and two thread wake-ups a side (a
median hand-over of 0.8-1.3 ms between sleeping stages on 2 cores, against
0.3-0.6 here; docs/pipeline.md). Here a value is one write and one read
(``sendmsg`` of the header and the tensor's own memory; ``recv_into`` the new
tensor's), and the words that values were taken ride along. The calls on a
value's way are few and cheap (``struct``, not torch): a stage often comes to
them from a sleep, when every call costs many times its warm cost
(docs/pipeline.md, "The hand-over").

The connections are made by ``open_socket_link`` (worker/pipeline/linkconnect.py).
"""

from __future__ import annotations

import ctypes
import itertools
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from shardps.worker.pipeline.link import HEADER_LEN, LinkError, _what, header_fields, parse_header
from shardps.worker.pipeline.schedule import Kind, Task

ACK_MAGIC = 0x4B41  # "AK": a receiver's word that the walk took a value
_FRAME = struct.Struct(f"<{HEADER_LEN}q")  # a frame's header (a value's, or an acknowledgement's)
HEADER_BYTES = _FRAME.size
_ZEROS = (0,) * (HEADER_LEN - 4)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous, non-empty CPU tensor's memory as bytes, without a copy (the caller keeps ``t``)."""
    return memoryview((ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())).cast("B")


class _Inbox:
    """What one neighbour's connection brought: complete frames, and the one being read."""

    def __init__(self) -> None:
        self.header = bytearray(HEADER_BYTES)
        self.got = 0  # bytes of the current frame's header read
        self.value: torch.Tensor | None = None  # the current frame's payload, being read into
        self.view: memoryview | None = None
        self.filled = 0
        self.meta: tuple[Kind, int, int] | None = None
        self.values: deque[tuple[Kind, int, int, torch.Tensor | None]] = deque()  # complete, not yet taken
        self.lost: str | None = None  # why the connection ended (None: it is up)


class SocketLink:
    """Stage ``stage`` of ``num_stages`` handing values to its neighbours over ``socks`` (neighbour ->
    connected socket; this link owns them). See the module docstring."""

    def __init__(self, socks: dict[int, socket.socket], stage: int, num_stages: int) -> None:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        for peer in socks:
            if abs(peer - stage) != 1 or not 0 <= peer < num_stages:
                raise ValueError(f"stage {stage} connects to its neighbours only, not to stage {peer}")
        self.stage, self.num_stages = stage, num_stages
        self.step, self.timeout = 0, 600.0
        self._deadline = time.monotonic() + self.timeout
        self._socks: dict[int, socket.socket] | None = dict(socks)
        self._by_fd = {s.fileno(): p for p, s in socks.items()}
        self._poll = select.poll()
        for s in socks.values():
            s.setblocking(False)
            self._poll.register(s.fileno(), select.POLLIN)
        self._in = {p: _Inbox() for p in socks}
        # Bytes the kernel did not take at once, per neighbour, with what keeps them alive. While a
        # neighbour is in ``_busy`` its queue is the writer thread's to write (this thread only appends).
        self._out: dict[int, deque[tuple[memoryview, Any]]] = {p: deque() for p in socks}
        self._busy: set[int] = set()
        self._failed: dict[int, str] = {}  # neighbour -> why the writer could not write to it
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None  # started the first time the kernel does not take a value
        self._unacked: dict[int, deque[tuple[Kind, int]]] = {p: deque() for p in socks}  # sent, not yet taken
        self._taken: dict[int, tuple[Kind, int]] = {}  # neighbour -> the last of our values it took
        self._acks: dict[int, list[tuple[memoryview, Any]]] = {}  # our words that we took values, held back
        self._to_come: dict[int, int] | None = None

    # -- the Link -------------------------------------------------------------------------------------

    def start(self, step: int, timeout: float, orders: Sequence[Sequence[Task]] | None = None) -> None:
        """A step begins: its values carry ``step``, and every wait of it ends ``timeout`` seconds from now.
        ``orders``: every stage's tasks in its order (``StepPlan.orders``), to know each neighbour's last
        value of the step (the word that it was taken goes at once); values are read as they come."""
        self._socks_or_raise()
        self.step, self.timeout = step, timeout
        self._deadline = time.monotonic() + timeout
        self._taken = {}
        # Values still to come from each neighbour this step (from the orders): the words that this stage
        # took them are held back (see ``_send_acks``) but for the last one, which goes at once, so that the
        # neighbour's ``flush`` does not wait for this stage's next wait. Without orders every word goes at once.
        self._to_come = None if orders is None else {
            n: sum(1 for t in orders[self.stage] if t.kind is k)
            for n, k in ((self.stage - 1, Kind.FORWARD), (self.stage + 1, Kind.BACKWARD)) if n in self._in}

    def send(self, kind: Kind, stage: int, mb: int, value: torch.Tensor | None, /) -> None:
        """Hand stage ``stage``'s ``kind`` value of ``mb`` to its neighbour (the next stage for a forward
        output, the previous for an input gradient). Writes what the kernel takes now; the writer thread
        writes the rest (``flush`` waits for the neighbour to take it)."""
        if stage != self.stage:
            raise ValueError(f"stage {self.stage} cannot send as stage {stage}")
        peer = stage + 1 if kind is Kind.FORWARD else stage - 1
        if not 0 <= peer < self.num_stages:
            raise ValueError(f"stage {stage} has no neighbour to send {_what(kind, mb)} to")
        socks = self._socks_or_raise()
        header = _FRAME.pack(*header_fields(kind, mb, self.step, value))
        if self._in[peer].lost is not None:
            raise self._lost(peer, kind, mb, sending=True)
        frames: list[tuple[memoryview, Any]] = [(memoryview(header), None)]
        if value is not None:
            if value.device.type != "cpu" or not value.is_contiguous():
                value = value.detach().cpu().contiguous()
            if value.nbytes:
                frames.append((_bytes_of(value), value))
        self._unacked[peer].append((kind, mb))
        self._put(peer, socks[peer], self._acks.pop(peer, []) + frames, kind, mb)

    def recv(self, kind: Kind, stage: int, mb: int, /) -> torch.Tensor | None:
        """Stage ``stage``'s ``kind`` value of ``mb`` (the next one it sends here), blocking until it is
        there or the step's deadline; ``LinkError`` when it cannot come or another value came."""
        if abs(stage - self.stage) != 1 or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {self.stage} receives from its neighbours only, not from stage {stage}")
        self._socks_or_raise()
        inbox = self._in[stage]
        self._wait(lambda: bool(inbox.values), stage, kind, mb, sending=False)
        got_kind, got_mb, got_step, value = inbox.values.popleft()
        if (got_kind, got_mb, got_step) != (kind, mb, self.step):
            raise LinkError(f"stage {self.stage} expected {_what(kind, mb)} of step {self.step} from stage {stage}, "
                            f"got {_what(got_kind, got_mb)} of step {got_step}", stage, kind, mb, "mismatch")
        if inbox.lost is None:  # (one that is gone took its values: there is no one to tell)
            ack = _FRAME.pack(ACK_MAGIC, 0 if kind is Kind.FORWARD else 1, mb, self.step, *_ZEROS)
            self._acks.setdefault(stage, []).append((memoryview(ack), None))
            if self._to_come is None or self._to_come.get(stage, 0) <= 1:
                self._send_acks()
        if self._to_come is not None and stage in self._to_come:
            self._to_come[stage] -= 1
        return value

    def flush(self) -> None:
        """Wait until every value sent has been taken by its neighbour (within the step's deadline)."""
        self._send_acks()
        for peer in list(self._out):
            queue = self._unacked[peer]
            if queue:
                kind, mb = queue[0]
                self._wait(lambda q=queue: not q, peer, kind, mb, sending=True)
        with self._cond:  # our words that we took its values: out, unless it is gone (then its wait says so)
            self._cond.wait_for(lambda: not self._busy or self._socks is None,
                                max(0.0, self._deadline - time.monotonic()))

    def close(self) -> None:
        """Close the connections (neighbours waiting on this stage fail at once)."""
        self._acks = {}
        with self._cond:
            socks, self._socks = self._socks, None
            for out in self._out.values():
                out.clear()
            self._busy.clear()
            self._cond.notify_all()
        for s in (socks or {}).values():
            try:
                s.close()
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._socks is None

    # -- the connections ------------------------------------------------------------------------------

    def _send_acks(self) -> None:
        """Write the words held back that this stage took its neighbours' values (each goes with the next
        value to that neighbour, or when this stage is about to wait, or at ``flush``)."""
        if not self._acks:
            return
        socks = self._socks_or_raise()
        for peer, frames in list(self._acks.items()):
            del self._acks[peer]
            if self._in[peer].lost is None:  # (one that is gone took its values: there is no one to tell)
                try:
                    self._put(peer, socks[peer], frames, Kind.FORWARD, -1)
                except LinkError:
                    pass  # it ended after handing its values over: the next wait on it says so

    def _socks_or_raise(self) -> dict[int, socket.socket]:
        if self._socks is None:
            raise RuntimeError(f"stage {self.stage}: the pipeline's connections were closed (after a failure)")
        return self._socks

    def _put(self, peer: int, sock: socket.socket, frames: list[tuple[memoryview, Any]], kind: Kind,
             mb: int) -> None:
        """Write ``frames`` to ``peer``: what the kernel takes now, here; the rest by the writer thread."""
        out = self._out[peer]
        with self._cond:
            if peer in self._failed:
                self._in[peer].lost = self._in[peer].lost or self._failed[peer]
                raise self._lost(peer, kind, mb, sending=True)
            out.extend(frames)
            if peer in self._busy:
                return  # behind what the writer still writes
        try:
            self._write_some(sock, out)
        except OSError as e:
            self._in[peer].lost = f"{type(e).__name__}: {e.strerror or e}"
            out.clear()
            raise self._lost(peer, kind, mb, sending=True) from e
        if out:
            with self._cond:
                self._busy.add(peer)
                self._cond.notify_all()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_behind, daemon=True,
                                                name=f"stage-{self.stage}-link-writer")
                self._writer.start()

    @staticmethod
    def _write_some(sock: socket.socket, out: deque[tuple[memoryview, Any]]) -> None:
        """Write from the front of ``out`` until it is empty or the kernel takes no more."""
        while out:
            try:
                n = sock.sendmsg([v for v, _ in itertools.islice(out, 64)])
            except BlockingIOError:
                return
            while n and out:
                view, keep = out[0]
                if n >= len(view):
                    n -= len(view)
                    out.popleft()
                else:
                    out[0] = (view[n:], keep)
                    n = 0

    def _write_behind(self) -> None:
        """The writer thread: writes the queues of the neighbours in ``_busy`` as their connections drain."""
        poll = select.poll()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._busy or self._socks is None)
                socks = self._socks
                if socks is None:
                    return
                busy = {socks[p].fileno(): p for p in self._busy}
            for fd in busy:
                poll.register(fd, select.POLLOUT)
            ready = poll.poll(500)
            for fd in busy:
                poll.unregister(fd)
            for fd, _ in ready:
                p = busy[fd]
                out = self._out[p]
                try:
                    self._write_some(socks[p], out)
                except (OSError, ValueError) as e:
                    with self._cond:
                        self._failed[p] = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
                        out.clear()
                with self._cond:
                    if not out:
                        self._busy.discard(p)
                        self._cond.notify_all()

    def _read(self, peer: int, sock: socket.socket) -> None:
        """Read what ``peer``'s connection holds into frames, until it holds no more."""
        inbox = self._in[peer]
        while inbox.lost is None:
            try:
                if inbox.view is None:
                    n = sock.recv_into(memoryview(inbox.header)[inbox.got:])
                else:
                    n = sock.recv_into(inbox.view[inbox.filled:])
            except BlockingIOError:
                return
            except OSError as e:
                inbox.lost = f"{type(e).__name__}: {e.strerror or e}"
                return
            if n == 0:
                inbox.lost = "its connection closed"
                return
            if inbox.view is None:
                inbox.got += n
                if inbox.got == HEADER_BYTES:
                    self._header(peer, inbox)
            else:
                inbox.filled += n
                if inbox.filled == len(inbox.view):
                    self._complete(inbox)

    def _header(self, peer: int, inbox: _Inbox) -> None:
        inbox.got = 0
        h = _FRAME.unpack(inbox.header)
        if h[0] == ACK_MAGIC:
            kind, mb = (Kind.FORWARD if h[1] == 0 else Kind.BACKWARD), h[2]
            queue = self._unacked[peer]
            while queue:  # words come in the order the values were sent
                if queue.popleft() == (kind, mb):
                    break
            self._taken[peer] = (kind, mb)
            return
        try:
            kind, mb, step, dtype, shape = parse_header(h)
        except ValueError as e:
            inbox.lost = f"it sent what is not a frame ({e})"
            return
        inbox.meta = (kind, mb, step)
        if dtype is None:
            inbox.values.append((kind, mb, step, None))
            return
        inbox.value = torch.empty(shape, dtype=dtype)
        if not inbox.value.nbytes:
            self._complete(inbox)
            return
        inbox.view, inbox.filled = _bytes_of(inbox.value), 0

    @staticmethod
    def _complete(inbox: _Inbox) -> None:
        assert inbox.meta is not None
        inbox.values.append((*inbox.meta, inbox.value))
        inbox.value, inbox.view, inbox.meta = None, None, None

    def _wait(self, done: Any, peer: int, kind: Kind, mb: int, sending: bool) -> None:
        """Poll every connection until ``done()``, reading what comes into frames (the held-back words go
        first). ``LinkError`` when ``peer`` (the one waited on) is gone or the step's deadline passes."""
        socks = self._socks_or_raise()
        if not done():
            self._send_acks()  # about to wait: the words held back go now, off the stage's critical path
        while not done():
            if peer in self._failed:
                self._in[peer].lost = self._in[peer].lost or self._failed[peer]
            if self._in[peer].lost is not None:
                raise self._lost(peer, kind, mb, sending)
            left = self._deadline - time.monotonic()
            if left <= 0:
                what = _what(kind, mb)
                msg = (f"stage {self.stage}: {what} it sent was not taken by stage {peer} within {self.timeout:g}s"
                       if sending else f"stage {self.stage} waited {self.timeout:g}s (the step's deadline) for "
                                       f"{what} from stage {peer}")
                raise LinkError(msg, peer, kind, mb, "timeout")
            for fd, _ in self._poll.poll(max(1, int(left * 1000 + 1))):
                p = self._by_fd[fd]
                self._read(p, socks[p])
                if self._in[p].lost is not None:
                    self._poll.unregister(fd)
                    self._by_fd.pop(fd)

    def _lost(self, peer: int, kind: Kind, mb: int, sending: bool) -> LinkError:
        cause = self._in[peer].lost or "its connection closed"
        return LinkError(f"stage {self.stage} lost stage {peer} while {'sending it' if sending else 'waiting for'} "
                         f"{_what(kind, mb)} ({cause})", peer, kind, mb, "send" if sending else "lost",
                         self._taken.get(peer))
