"""The server process's data port (protos/dataconn.py): one port for all its shards, one connection per worker.

``DataPort.shared(host)`` is the process's port on ``host`` (made by the
first shard that asks, closed with the last): each shard ``attach``es its
Workers servicer and gets a *route*, the number its frames name. At
Register the shard hands the worker the port, the worker's token
(``offer``: one per worker and process) and its route. The worker connects
once per process and says hello with the token.

Each connection (``Conn``) has one thread reading its frames:

- a ``PUSH`` frame's control is parsed first; each fp32 part's extent is
  then read straight into that part's staging buffer (``WorkersServicer.landing``:
  the buffer the assembler would copy it into), any other into the route's
  push buffer (one per route and connection, grown to what the worker's
  layout needs); then the Push is decoded, checked and applied in that same
  thread, as the gRPC handler would (``WorkersServicer.push_frames``), and
  answered: no hand-off between threads (but for a shard holding split
  tensors, whose step waits for its peers: a peer in this process may need
  a frame behind this one, so its Push runs in a pool thread);
- a streamed Push (``PUSH_PART`` ... ``PUSH_END``) runs in a thread of its
  own (its gradients come while the worker computes), fed message by
  message;
- a ``PUSH_PULL`` (a Push carrying its shard's Pull) is a ``PUSH``, answered
  so; once the Push is taken in, its Pull, from the version the answer
  names, is made as a ``PULL`` frame's (below; a refused Push's Pull is
  answered ``NOT_MADE``);
- a ``PULL`` whose weights are there is answered by that same thread; one
  that must wait parks on the shard's state without a thread
  (server/parked.py, ``WorkersServicer.pull_soon``) and is answered by the
  thread whose change releases it (the round's last Push), or at its
  deadline (``DataPort.deadlines``); the answer is framed once per
  version for every such Pull (under bsp, each worker's of a round) and
  sent from the weights themselves (``Reader.read_lent``: no copy; a rest
  the socket did not take is copied by the connection's ``Sender`` before
  the next step changes them), or, where they are cast (a bf16 wire) or
  under TLS, from a copy every such Pull shares (``Reader.read_shared``). A shard with a
  backup, or a Pull naming slices, waits in a pool thread instead
  (``WorkersServicer.pull_frames``), its weights written into the route's
  pull buffer;
- a worker on this machine sends the same frames with no extents: its
  Push's messages name its shared-memory segment (written before the frame
  went), its Pull asks the weights written into its pull segment
  (``Reader.read_into``), the answer saying where (no bytes after it).

Every answer goes through the connection's ``Sender`` (protos/dataconn.py):
written by the answering thread as far as the socket takes it, the rest by
the connection's writer thread, so that no thread that reads frames ever
waits on a worker's socket.

Every chunk that names ``FRAME_SEGMENT`` must lie in an extent its call's
frames brought (``FrameSegments``): a part the worker did not send, or one
it sent for another call, is INVALID_ARGUMENT naming the tensor and the
bytes, and the Push changes nothing. A request of another worker than the
hello's is PERMISSION_DENIED. A frame that breaks the protocol ends the
connection (logged); the worker's calls then go over gRPC.

Thread-safety: every method may be called from any thread. ``release``
(the last shard's) closes every connection and joins every thread this
module started.
"""

from __future__ import annotations

import collections
import logging
import mmap
import queue
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from shardps.protos import dataconn as wire
from shardps.protos import shm
from shardps.protos.deadlines import Deadlines
from shardps.protos.security import keepalive_seconds
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.reader import Lent
from shardps.server.errors import DeadlineExceeded, InvalidArgument, StoreError, Unavailable
from shardps.server.rpc import details

if TYPE_CHECKING:
    from shardps.server.datapath.assembly import Landing
    from shardps.server.datapath.shm import SegmentCache, Segments

log = logging.getLogger("shardps.server")

_CODES = {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
          "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
          "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14}
_END = object()  # a streamed Push's end, in its queue


class WorkersServicer(Protocol):
    """What a route serves (server/service.py's ``WorkersServicer``): its Push and Pull, its segments."""

    segments: SegmentCache
    metrics: Any
    store: Any

    def push_frames(self, requests: Iterator[ps_pb2.PushRequest], segments: Segments,
                    landed: Landing | None = None) -> ps_pb2.PushResponse: ...

    def landing(self, messages: Sequence[ps_pb2.PushRequest]) -> Landing | None: ...

    def pull_frames(self, request: ps_pb2.PullRequest, timeout: float, segments: Segments) -> Iterator[bytes]: ...

    def pull_soon(self, request: ps_pb2.PullRequest, timeout: float, segments: Segments, deadlines: Deadlines,
                  answer: Callable[[list[bytes] | None, memoryview | Lent | None, BaseException | None], None]
                  ) -> bool: ...

    def wait_limit(self, remaining: float | None) -> float: ...


class PermissionDenied(StoreError):
    code = "PERMISSION_DENIED"


class Buffer:
    """A route's push or pull buffer on one connection: anonymous pages, grown (never shrunk) on demand."""

    def __init__(self) -> None:
        self.size = 0
        self._mm: mmap.mmap | None = None

    def at_least(self, nbytes: int) -> memoryview:
        if self._mm is None or nbytes > self.size:
            self.close()
            self.size = max(1, nbytes)
            self._mm = mmap.mmap(-1, self.size)
        return memoryview(self._mm)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still held (a call being answered): the pages go with the last one
                pass
            self._mm = None


class PullBuffer(shm.Segment):
    """A Pull's view of its route's pull buffer: remembers how far the weights were written. ``lends``: its
    answer may be sent from the weights themselves (``Reader.read_lent``; not under TLS, whose writes copy)."""

    def __init__(self, buf: Buffer, nbytes: int, lends: bool = False) -> None:
        view = buf.at_least(nbytes)
        super().__init__(wire.FRAME_SEGMENT, nbytes, view.obj, owner=False)  # type: ignore[arg-type]
        self.used = 0
        self.lends = lends

    def view(self, offset: int, nbytes: int) -> memoryview:
        out = super().view(offset, nbytes)
        self.used = max(self.used, offset + nbytes)
        return out


class FrameSegments:
    """What a frame's Push or Pull reads its chunks from: its frames' extents for ``FRAME_SEGMENT``, the
    shard's shared-memory segments for any other name (module docstring)."""

    def __init__(self, shared: SegmentCache, push: memoryview | None = None,
                 extents: list[tuple[int, int]] | None = None, pull: PullBuffer | None = None,
                 landed: dict[int, memoryview] | None = None) -> None:
        self._shared, self._push, self.extents, self._pull = shared, push, extents if extents is not None else [], pull
        self._landed = landed or {}  # extents read straight into staging buffers (their offset -> their bytes)

    def view(self, worker_id: int, name: str, offset: int, nbytes: int, tensor: str = "") -> memoryview:
        if name != wire.FRAME_SEGMENT:
            return self._shared.view(worker_id, name, offset, nbytes, tensor)
        covered = self._push is not None and any(o <= offset and offset + nbytes <= o + n for o, n in self.extents)
        if nbytes and not covered:
            sent = ", ".join(f"[{o}, {o + n})" for o, n in self.extents[:8]) or "none"
            raise InvalidArgument(f"tensor {tensor!r}: expected its bytes [{offset}, {offset + nbytes}) in the "
                                  f"call's frames, received {sent}{' ...' if len(self.extents) > 8 else ''}")
        landed = self._landed.get(offset)
        if landed is not None and landed.nbytes == nbytes:
            return landed
        return self._push[offset : offset + nbytes] if self._push is not None else memoryview(b"")

    def get(self, worker_id: int, name: str) -> shm.Segment:
        if name != wire.FRAME_SEGMENT:
            return self._shared.get(worker_id, name)
        if self._pull is None:
            raise InvalidArgument("a Pull names the frame's bytes, but came on no data connection")
        return self._pull


def error_answer(e: BaseException) -> tuple[int, bytes]:
    """A failed call's status and message: a StoreError's own; UNAVAILABLE for a worker's segment closed while
    the call used it (the worker registered again, or left: it asks again on the path it has now); anything
    else INTERNAL (logged)."""
    if isinstance(e, StoreError):
        return _CODES.get(e.code, _CODES["INTERNAL"]), details(e).encode()
    if isinstance(e, shm.SegmentClosed):
        return _CODES["UNAVAILABLE"], f"{e} while the call used it: ask again".encode()
    log.exception("data connection call failed")
    return _CODES["INTERNAL"], f"{type(e).__name__}: {e}".encode()[:2000]


class Conn:
    """One worker's connection: its reading thread, its routes' buffers, its streamed Pushes."""

    def __init__(self, port: DataPort, worker_id: int, sock: socket.socket, timeout: float) -> None:
        self.port, self.worker_id, self.sock, self.timeout = port, worker_id, sock, timeout
        self.sender = wire.Sender(sock, f"shardps-data-w{worker_id}", self._send_failed)
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._push: dict[int, Buffer] = {}
        self._pull: dict[int, Buffer] = {}
        self._bufs_lock = threading.Lock()  # ``forget`` and ``close`` against each other (any thread)
        self._streams: dict[int, queue.SimpleQueue[Any]] = {}  # call -> its messages, as they come
        self._stream_extents: dict[int, list[tuple[int, int]]] = {}
        self._ended: collections.deque[int] = collections.deque(maxlen=4096)  # streamed calls that ended
        self.closed = False
        self.error = ""
        self._thread = threading.Thread(target=self._run, name=f"shardps-data-w{worker_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def answer(self, kind: int, call: int, status: int, ctl: list[bytes], payload: memoryview | Lent | None = None
               ) -> None:
        """An answer frame; ``payload``: its bytes, or the weights themselves lent (``Reader.read_lent``: the
        sender copies a rest the socket did not take before the next step changes them)."""
        nctl = sum(map(len, ctl))
        nbytes = payload.nbytes if payload is not None else 0
        frame = wire.head_and_control(wire.ANSWER.pack(wire.ANSWER_MAGIC, kind, call, status, nctl, nbytes), ctl,
                                      nctl)
        lent = None
        if isinstance(payload, Lent):
            frame.extend(payload.views)
            lent = payload
        elif payload is not None:
            frame.append(payload)
        try:
            self.sender.send(frame, lent)
        except OSError as e:
            log.info("data connection of worker %d: answer to call %d not sent (%s)", self.worker_id, call, e)
            # Shut, not closed here: closing joins the reading thread, which may be in a step that waits for
            # this very answer's read of the weights to end (the lent payload, closed once this returns). The
            # reading thread ends at the shut socket and closes the connection itself.
            self._shut()

    def _send_failed(self, why: str) -> None:
        """The writer thread could not send (the worker went): the connection ends."""
        log.info("data connection of worker %d: %s", self.worker_id, why)
        self._shut()

    def _run(self) -> None:
        head = bytearray(wire.REQUEST.size)
        why = ""
        try:
            while True:
                wire.fill(self.sock, memoryview(head), idle=lambda: not self.closed)
                self._frame(*wire.REQUEST.unpack(head))
        except wire.Torn as t:
            why = "" if self.closed else t.why
        except wire.ProtocolError as e:
            why = f"protocol error: {e}"
            log.warning("data connection of worker %d closed: %s", self.worker_id, e)
        except Exception as e:  # noqa: BLE001 - whatever ends the reading ends the connection, logged
            why = f"{type(e).__name__}: {e}"
            log.exception("data connection of worker %d failed", self.worker_id)
        finally:
            self.error = why or "closed"
            for q in list(self._streams.values()):
                q.put(Unavailable(f"the data connection of worker {self.worker_id} ended ({self.error})"))
            self.close()

    def _frame(self, magic: bytes, kind: int, call: int, route: int, timeout_ms: int, nctl: int, next_: int,
               buffer_bytes: int) -> None:
        if magic != wire.REQUEST_MAGIC:
            raise wire.ProtocolError(f"not a request frame (starts {bytes(magic)!r})")
        if kind not in wire.KINDS:
            raise wire.ProtocolError(f"call {call}: unknown frame kind {kind}")
        if nctl > wire.MAX_CTL or next_ > wire.MAX_EXTENTS or buffer_bytes > wire.MAX_BUFFER:
            raise wire.ProtocolError(f"call {call}: {nctl} control bytes, {next_} extents, a {buffer_bytes}-byte "
                                     f"buffer: over the limits ({wire.MAX_CTL}, {wire.MAX_EXTENTS}, "
                                     f"{wire.MAX_BUFFER})")
        if kind == wire.PULL and next_:
            raise wire.ProtocolError(f"call {call}: a pull frame with {next_} extents")
        if kind == wire.PING:
            if nctl or next_:
                raise wire.ProtocolError(f"a ping frame with {nctl} control bytes and {next_} extents")
            self.answer(wire.PING, call, wire.OK, [])
            return
        started = time.monotonic()  # a carried Pull's deadline counts from here, as the worker's does
        nraw = next_ * wire.EXTENT.size
        both = wire.read_exact(self.sock, nctl + nraw)  # the control and the extents' table: one read
        ctl = both if not nraw else memoryview(both)[:nctl]
        extents = [wire.EXTENT.unpack_from(both, nctl + i * wire.EXTENT.size) for i in range(next_)]
        wire.check_extents(extents, buffer_bytes)
        servicer = self.port.servicer(route)
        messages: list[ps_pb2.PushRequest] | StoreError = []
        carried: ps_pb2.PullRequest | None = None  # PUSH_PULL: the Pull its frame carries
        regions: dict[int, memoryview] = {}
        landed = None
        if servicer is not None and kind in (wire.PUSH, wire.PUSH_PULL):
            try:
                if kind == wire.PUSH_PULL:
                    carried, messages = self._carried(ctl)
                else:
                    messages = self._messages(ctl)
            except StoreError as e:  # answered below, once the frame's bytes are read
                messages = e
            else:
                landed = self._landing(servicer, messages) if extents else None
                regions = landed.regions if landed is not None else {}
        target = None
        filled: dict[int, memoryview] = {}  # extents read straight into staging buffers
        if extents:
            target = self._push.setdefault(route, Buffer()).at_least(buffer_bytes) if servicer else None
            for offset, nbytes in extents:
                if target is None:
                    wire.discard(self.sock, nbytes)
                    continue
                into = regions.get(offset)
                if into is not None and into.nbytes == nbytes:
                    wire.fill(self.sock, into)
                    filled[offset] = into
                else:
                    wire.fill(self.sock, target[offset : offset + nbytes])
        if servicer is not None and kind != wire.PULL:  # what a Push counts on gRPC: the frame, header and all
            self.port.received(route, wire.REQUEST.size + nctl + nraw + sum(n for _, n in extents))
        timeout = min(timeout_ms / 1000.0, self.timeout) if timeout_ms else self.timeout
        if servicer is None:
            self._streams.pop(call, None)
            if kind != wire.PUSH_PART:
                self.answer(wire.PUSH if kind == wire.PUSH_PULL else kind, call, _CODES["UNAVAILABLE"],
                            [f"no shard serves route {route} on this data port (stopped?)".encode()])
            if kind == wire.PUSH_PULL:
                self.answer(wire.PUSH_PULL, call, wire.NOT_MADE, [b"Pull: not made, no shard serves its route"])
            return
        if kind == wire.PULL:
            self._pull_frame(servicer, call, route, bytes(ctl), buffer_bytes, timeout, wire.PULL)
            return
        if kind in (wire.PUSH, wire.PUSH_PULL):
            args = (servicer, call, route, messages, target if extents else None, extents, landed, filled,
                    kind == wire.PUSH_PULL, carried, started, timeout)
            if servicer.store.table.has_split():
                # Its step waits for its peers' statistics; a peer in this process needs this worker's Push,
                # which may be a frame behind this one: the reading thread must not wait on it.
                self.port.pool.submit(self._push_then_pull, *args)
            else:
                self._push_then_pull(*args)
            return
        self._stream_frame(servicer, kind, call, route, ctl, extents, timeout)

    def _push_then_pull(self, servicer: WorkersServicer, call: int, route: int,
                        messages: list[ps_pb2.PushRequest] | StoreError, target: memoryview | None,
                        extents: list[tuple[int, int]], landed: Landing | None, filled: dict[int, memoryview],
                        carries: bool, carried: ps_pb2.PullRequest | None, started: float, timeout: float) -> None:
        """A ``PUSH`` or ``PUSH_PULL`` frame's calls: the Push, then, once it was taken in, its carried Pull from
        the version the Push's answer named (``_push_call``), its deadline counted from the frame's arrival."""
        if self._push_call(servicer, call, messages, target, extents, landed, filled, carries, carried) \
                and carried is not None:
            left = max(0.0, timeout - (time.monotonic() - started))
            self._pull_frame(servicer, call, route, carried, carried.frame_bytes, left, wire.PUSH_PULL)

    def _messages(self, ctl: bytes | bytearray | memoryview) -> list[ps_pb2.PushRequest]:
        try:
            messages = wire.split(ctl)
        except wire.ProtocolError as e:  # the frame's length held: only its control is malformed
            raise InvalidArgument(f"Push: the frame's control does not split into messages: {e}") from None
        return self._pushes(messages, 1)

    def _carried(self, ctl: bytes | bytearray | memoryview) -> tuple[ps_pb2.PullRequest, list[ps_pb2.PushRequest]]:
        """A ``PUSH_PULL`` frame's control: its PullRequest (first), then its PushRequests."""
        try:
            messages = wire.split(ctl)
        except wire.ProtocolError as e:
            raise InvalidArgument(f"Push and pull: the frame's control does not split into messages: {e}") from None
        if len(messages) < 2:
            raise InvalidArgument(f"Push and pull: expected a PullRequest and at least one PushRequest in the "
                                  f"frame's control, received {len(messages)} message(s)")
        pull = self._pull_request(messages[0])
        if pull.shm != wire.FRAME_SEGMENT or pull.slices:
            raise InvalidArgument(f"Push and pull: the carried Pull must name the frame's bytes "
                                  f"(shm {wire.FRAME_SEGMENT!r}) and no slices; received shm {pull.shm!r} and "
                                  f"{len(pull.slices)} slice(s)")
        if not 0 <= pull.frame_bytes <= wire.MAX_BUFFER:
            raise InvalidArgument(f"Push and pull: the carried Pull's frame_bytes must be in [0, "
                                  f"{wire.MAX_BUFFER}], received {pull.frame_bytes}")
        return pull, self._pushes(messages[1:], 2)

    def _pushes(self, messages: list[bytes], first: int) -> list[ps_pb2.PushRequest]:
        """Each message parsed as a PushRequest of this connection's worker (``first``: the first one's number
        in the frame, for the error)."""
        out = []
        for i, m in enumerate(messages, start=first):
            try:
                req = ps_pb2.PushRequest.FromString(m)
            except Exception as e:  # noqa: BLE001 - a message that does not parse is the caller's error
                raise InvalidArgument(f"Push: message {i} of the frame does not parse as a PushRequest: {e}") from None
            self._own(req.worker_id, "Push")
            out.append(req)
        return out

    def _own(self, worker_id: int, rpc: str) -> None:
        if worker_id != self.worker_id:
            raise PermissionDenied(f"{rpc}: the data connection of worker {self.worker_id} carried a request of "
                                   f"worker {worker_id}")

    def _landing(self, servicer: WorkersServicer, messages: list[ps_pb2.PushRequest]) -> Landing | None:
        """Where this Push's chunks may be read straight from the socket (``WorkersServicer.landing``); None
        where nothing may, or finding out failed (the frame's buffer then takes every byte, as before)."""
        try:
            return servicer.landing(messages)
        except Exception:  # noqa: BLE001 - an allocation that failed: the assembler says so, copying
            return None

    def _push_call(self, servicer: WorkersServicer, call: int, messages: list[ps_pb2.PushRequest] | StoreError,
                   target: memoryview | None, extents: list[tuple[int, int]], landed: Landing | None,
                   filled: dict[int, memoryview], carries: bool = False,
                   carried: ps_pb2.PullRequest | None = None) -> bool:
        """A whole Push: its messages (parsed as its frame was read, or why they did not parse), its bytes in
        the route's buffer ``target`` or, ``filled``, in the staging buffers of ``landed``. Whether it was
        taken in; ``carries`` (a ``PUSH_PULL``): a refused one's Pull is answered NOT_MADE, and ``carried``,
        the Pull, takes the answer's ready version as its ``min_version``."""
        try:
            if isinstance(messages, StoreError):
                raise messages
            segments = FrameSegments(servicer.segments, target, extents, landed=filled)
            answer = servicer.push_frames(iter(messages), segments, landed if filled else None)
        except Exception as e:  # noqa: BLE001 - answered as its status
            self.answer(wire.PUSH, call, *self._failed(servicer, "Push", e))
            if carries:
                self.answer(wire.PUSH_PULL, call, wire.NOT_MADE,
                            [b"Pull: not made, the push that carried it was refused"])
            return False
        if carried is not None:
            carried.min_version = answer.ready_version
        self.answer(wire.PUSH, call, wire.OK, [answer.SerializeToString()])
        return True

    def _stream_frame(self, servicer: WorkersServicer, kind: int, call: int, route: int, ctl: bytearray | memoryview,
                      extents: list[tuple[int, int]], timeout: float) -> None:
        q = self._streams.get(call)
        if q is None:
            if call in self._ended:
                self.answer(wire.PUSH_END, call, _CODES["INVALID_ARGUMENT"],
                            [f"Push: a frame of call {call} came after that call ended".encode()])
                return
            q = self._streams[call] = queue.SimpleQueue()
            seen = self._stream_extents[call] = []
            self.port.streams.submit(self._stream_call, servicer, call, route, q, seen, timeout)
        self._stream_extents[call].extend(extents)
        try:
            q.put(self._messages(ctl))
        except StoreError as e:
            q.put(e)
        if kind == wire.PUSH_END:
            q.put(_END)
            del self._streams[call]
            self._ended.append(call)

    def _stream_call(self, servicer: WorkersServicer, call: int, route: int, q: queue.SimpleQueue[Any],
                     seen: list[tuple[int, int]], timeout: float) -> None:
        def messages() -> Iterator[ps_pb2.PushRequest]:
            while True:
                try:
                    item = q.get(timeout=timeout)
                except queue.Empty:
                    raise DeadlineExceeded(f"Push: call {call} sent nothing for {timeout:.0f}s") from None
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield from item

        try:
            buf = self._push.get(route)
            segments = FrameSegments(servicer.segments, buf.at_least(buf.size) if buf is not None else None, seen)
            answer = servicer.push_frames(messages(), segments)
            self.answer(wire.PUSH_END, call, wire.OK, [answer.SerializeToString()])
        except Exception as e:  # noqa: BLE001 - answered as its status
            self.answer(wire.PUSH_END, call, *self._failed(servicer, "Push", e))
        finally:
            self._stream_extents.pop(call, None)

    def _pull_request(self, ctl: bytes | bytearray | memoryview) -> ps_pb2.PullRequest:
        try:
            req = ps_pb2.PullRequest.FromString(bytes(ctl))
        except Exception as e:  # noqa: BLE001 - a message that does not parse is the caller's error
            raise InvalidArgument(f"Pull: the frame's control does not parse as a PullRequest: {e}") from None
        self._own(req.worker_id, "Pull")
        return req

    def _pull_frame(self, servicer: WorkersServicer, call: int, route: int, request: bytes | ps_pb2.PullRequest,
                    buffer_bytes: int, timeout: float, kind: int) -> None:
        """A Pull (its control, or a ``PUSH_PULL``'s parsed Pull), answered as ``kind``: without a thread
        where the shard can (``_pull_soon``), else in the pool's."""
        if not self._pull_soon(servicer, call, route, request, buffer_bytes, timeout, kind):
            self.port.pool.submit(self._pull_call, servicer, call, route, request, buffer_bytes, timeout, kind)

    def _pull_soon(self, servicer: WorkersServicer, call: int, route: int, request: bytes | ps_pb2.PullRequest,
                   buffer_bytes: int, timeout: float, kind: int) -> bool:
        """A Pull answered without a thread of its own where the shard can (server/parked.py): at once in
        this thread when its weights are there, else by the thread that makes them so; False when it needs
        the pool's thread (``WorkersServicer.pull_soon``)."""
        def answered(messages: list[bytes] | None, payload: memoryview | Lent | None, error: BaseException | None
                     ) -> None:
            if messages is None:
                assert error is not None
                self.answer(kind, call, *self._failed(servicer, "Pull", error))
                return
            self.answer(kind, call, wire.OK, wire.joined(messages), payload if payload else None)

        try:
            req = self._pull_request(request) if isinstance(request, bytes) else request
            if req.shm == wire.FRAME_SEGMENT:
                segments = FrameSegments(servicer.segments, pull=PullBuffer(self._pull.setdefault(route, Buffer()),
                                                                              buffer_bytes, lends=not self.tls))
            else:  # the worker's shared-memory segment (same host): the weights are written there
                segments = FrameSegments(servicer.segments)
            return servicer.pull_soon(req, servicer.wait_limit(timeout), segments, self.port.deadlines, answered)
        except Exception as e:  # noqa: BLE001 - answered as its status
            self.answer(kind, call, *self._failed(servicer, "Pull", e))
            return True

    def _pull_call(self, servicer: WorkersServicer, call: int, route: int, request: bytes | ps_pb2.PullRequest,
                   buffer_bytes: int, timeout: float, kind: int) -> None:
        try:
            req = self._pull_request(request) if isinstance(request, bytes) else request
            pull = PullBuffer(self._pull.setdefault(route, Buffer()), buffer_bytes) \
                if req.shm == wire.FRAME_SEGMENT else None
            # The wait ends a little before the worker's deadline, so that it reads this server's account of
            # what it waited for (as over gRPC: WorkersServicer._timeout).
            messages = servicer.pull_frames(req, servicer.wait_limit(timeout), FrameSegments(servicer.segments,
                                                                                              pull=pull))
            payload = pull.view(0, pull.used) if pull is not None and pull.used else None
            self.answer(kind, call, wire.OK, wire.joined(messages), payload)
        except Exception as e:  # noqa: BLE001 - answered as its status
            self.answer(kind, call, *self._failed(servicer, "Pull", e))

    def _failed(self, servicer: WorkersServicer, rpc: str, e: BaseException) -> tuple[int, list[bytes]]:
        status, text = error_answer(e)
        if servicer.metrics is not None and isinstance(e, StoreError):
            servicer.metrics.rpc_error(rpc, e.code)
        return status, [text]

    def forget(self, route: int) -> None:
        with self._bufs_lock:
            gone = [b for bufs in (self._push, self._pull) if (b := bufs.pop(route, None)) is not None]
        for b in gone:
            b.close()

    def _shut(self) -> None:
        """Shut the socket: the reading thread ends (and closes the connection)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """End the connection and join its threads (unless called from one). Idempotent."""
        self.closed = True
        self.sender.close()
        wire.end(self.sock, self._thread)
        with self._bufs_lock:  # a stopping shard's ``forget`` may run meanwhile, in another thread
            gone = [*self._push.values(), *self._pull.values()]
            self._push, self._pull = {}, {}
        for b in gone:
            b.close()


class DataPort:
    """A process's data port on one host (module docstring)."""

    _lock = threading.Lock()
    _ports: dict[str, DataPort] = {}

    @classmethod
    def shared(cls, host: str, tls: ssl.SSLContext | None = None) -> DataPort:
        """The process's port on ``host`` (with ``tls``, a TLS port: one per host and context), made on first
        use; every ``shared`` is matched by a ``release``."""
        key = f"{host}#{id(tls) if tls is not None else ''}"
        with cls._lock:
            port = cls._ports.get(key)
            if port is None:
                port = cls._ports[key] = DataPort(host, tls)
                port._key = key
            port._users += 1
            return port

    def __init__(self, host: str, tls: ssl.SSLContext | None = None) -> None:
        self.host, self.tls, self._key = host, tls, host
        self._users = 0
        self._mu = threading.Lock()
        self._routes: dict[int, WorkersServicer] = {}
        self._next_route = 1
        self._tokens: dict[int, bytes] = {}  # worker -> its token on this port
        self._conns: dict[int, list[Conn]] = {}  # each worker's connections (a worker, and readers under its id)
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.pool = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="shardps-data-pull")
        self.streams = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="shardps-data-push")
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host.strip("[]"), 0))
            self._listener.listen(256)
        except BaseException:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self.deadlines = Deadlines("shardps-data-deadlines")  # of the Pulls parked without a thread
        self._accepting = threading.Thread(target=self._accept, name=f"shardps-data-accept-{self.port}", daemon=True)
        self._accepting.start()

    def attach(self, servicer: WorkersServicer) -> int:
        """Serve ``servicer``'s shard here: the route its frames will name."""
        with self._mu:
            route = self._next_route
            self._next_route += 1
            self._routes[route] = servicer
            return route

    def servicer(self, route: int) -> WorkersServicer | None:
        with self._mu:
            return self._routes.get(route)

    def received(self, route: int, nbytes: int) -> None:
        servicer = self.servicer(route)
        if servicer is not None:
            servicer.store.job.received.add(nbytes)

    def offer(self, worker_id: int) -> tuple[int, bytes]:
        """The port and ``worker_id``'s token on it (one per worker and process: its Register on any shard)."""
        with self._mu:
            token = self._tokens.get(worker_id)
            if token is None:
                token = self._tokens[worker_id] = secrets.token_bytes(16)
            return self.port, token

    def forget(self, worker_id: int, route: int) -> None:
        """``worker_id`` left the shard of ``route``: that route's buffers on its connection go."""
        with self._mu:
            conns = list(self._conns.get(worker_id, ()))
        for conn in conns:
            conn.forget(route)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            t = threading.Thread(target=self._hello, args=(sock,), name="shardps-data-hello", daemon=True)
            with self._mu:
                if self._closed:
                    sock.close()
                    return
                self._threads = {x for x in self._threads if x.is_alive()}
                self._threads.add(t)
            t.start()

    def _hello(self, sock: socket.socket) -> None:
        """Check the worker's hello (5 s to say it), answer ACK, then read its frames."""
        try:
            wire.tune(sock, 5.0)
            if self.tls is not None:  # the handshake, then the hello inside it
                sock = self.tls.wrap_socket(sock, server_side=True)
            head = wire.read_exact(sock, wire.HELLO.size)
            magic, token, worker_id, timeout = wire.HELLO.unpack(head)
            with self._mu:
                known = self._tokens.get(worker_id)
            if magic != wire.HELLO_MAGIC or known is None or not secrets.compare_digest(known, token) \
                    or not 0 < timeout <= 86400:
                log.warning("a data connection said no valid hello: closed")
                sock.close()
                return
            wire.deadlines_in_kernel(sock, timeout)
            wire.keep_alive(sock, keepalive_seconds())  # a worker gone silent: its streamed Pushes end
            conn = Conn(self, worker_id, sock, timeout)
        except (OSError, wire.Torn) as e:  # ssl.SSLError is an OSError: a refused handshake
            log.warning("a data connection failed before its hello (%s): closed", e)
            sock.close()
            return
        with self._mu:  # beside the worker's others (a client that only pulls, under the same id), the ended gone
            self._conns[worker_id] = [c for c in self._conns.get(worker_id, ()) if not c.closed] + [conn]
            closed = self._closed
        if closed:
            conn.close()
            return
        try:
            sock.sendall(wire.ACK.pack(wire.ACK_MAGIC, 0))
        except OSError:
            conn.close()
            return
        conn.start()

    def detach(self, route: int) -> None:
        """The shard of ``route`` stopped: frames naming it are answered UNAVAILABLE."""
        with self._mu:
            self._routes.pop(route, None)
            conns = [c for cs in self._conns.values() for c in cs]
        for c in conns:
            c.forget(route)

    def release(self) -> None:
        """One user (a shard) is done with the port; the last closes it."""
        with DataPort._lock:
            self._users -= 1
            if self._users > 0:
                return
            if DataPort._ports.get(self._key) is self:
                del DataPort._ports[self._key]
        self.close()

    def close(self) -> None:
        """Stop listening, close every connection, join every thread. Idempotent."""
        with self._mu:
            self._closed = True
            conns, self._conns = [c for cs in self._conns.values() for c in cs], {}
            threads = list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._accepting.join()
        for conn in conns:
            conn.close()
        for t in threads:
            t.join()
        # A call still running ends by its own deadline (the store's max wait): joined, as gRPC's handlers are.
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.streams.shutdown(wait=True, cancel_futures=True)
        self.deadlines.close()
