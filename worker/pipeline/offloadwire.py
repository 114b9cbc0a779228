"""The offload store's wire: a stage's saved activations go to the store and come back over one connection.

Offload moves every saved activation twice a step, out after its forward
and back before its backward: bulk bytes, like a shard's pushes and pulls.
Through Ray's object store each bundle was pickled, copied into the local
object store, carried between the nodes' stores in chunks and copied out
again, both ways: 1.4-1.7x the step of offload off on a quiet machine
(docs/pipeline.md). Here it takes the path the links between stages and
the data connection take:

- ``ByteStore`` (in the store's process: the ``OffloadStore`` actor on Ray)
  listens on TCP at its host's address and, on Linux, on a Unix socket with
  a random abstract name, as a stage does for its neighbours
  (worker/pipeline/linkconnect.py). A client on the same host and network
  namespace takes the Unix one.
- ``SocketSink`` (a stage's side) keeps one connection to it, opened on
  first use and greeted with the store's token (16 random bytes the stage
  got from the store's actor, through Ray). Its calls are made by one
  background thread, in the order the stage asks, so that the stage's
  forward never waits for its bundle to be sent.
- A bundle's bytes are written with ``sendmsg`` straight from the tensors'
  memory, and read with ``recv_into`` straight into the tensors that hold
  them at the other end (``torch.empty``: no zeroing, no copy). What the
  tensors are (dtype, shape, the dtype and device to restore) stays with the
  stage; only their bytes travel.

Frames (little-endian): ``HELLO`` (magic, token), answered ``ANSWER`` with
no parts. A request is ``REQUEST`` (magic, op, name bytes, parts, payload
bytes), the bundle's name (UTF-8), ``parts`` sizes (``PART``) and, for a
``PUT``, the payload. The answer is ``ANSWER`` (magic, status, parts,
payload bytes) and, for a ``GET`` that found its bundle, the sizes and the
bytes; a status other than ``OK`` carries its message as the payload.
A frame outside the limits (``MAX_NAME``, ``MAX_PARTS``, sizes that do not
add up to the payload) ends the connection: a stage's offload then fails,
and its step with it, naming the store and the bundle.

Like the links between stages, the connection is not encrypted: it is
authenticated by the token and carries activations between the cluster's
own nodes (Ray's object transfers, which it replaces, are not encrypted
either unless Ray's TLS is on).
"""

from __future__ import annotations

import concurrent.futures
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardps.protos.dataconn import Torn, fill, send
from shardps.worker.pipeline.linkconnect import connect, listen, published
from shardps.worker.pipeline.socketlink import _bytes_of

log = logging.getLogger(__name__)

HELLO = struct.Struct("<Q16s")  # magic, token
REQUEST = struct.Struct("<QB7xQQQ")  # magic, op, name bytes, parts, payload bytes
ANSWER = struct.Struct("<QI4xQQ")  # magic, status, parts, payload bytes
PART = struct.Struct("<Q")
HELLO_MAGIC, REQUEST_MAGIC, ANSWER_MAGIC = 0x314F4C4C45485350, 0x3151455250535053, 0x3157534E41535053
PUT, GET, DROP = 1, 2, 3
OPS = {PUT: "put", GET: "get", DROP: "drop"}
OK, NOT_FOUND, REFUSED = 0, 1, 2
MAX_NAME = 4096
MAX_PARTS = 1 << 16

Meta = tuple[str, torch.dtype, tuple[int, ...], torch.dtype, torch.device]  # key, stored dtype, shape, dtype, device


class OffloadError(RuntimeError):
    """An offload transfer failed: names the store, the bundle and what happened."""


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _views(tensors: Sequence[torch.Tensor]) -> list[memoryview]:
    return [_bytes_of(t) for t in tensors if t.numel()]


class ByteStore:
    """Bundles of bytes by name, served over ``listen``'s sockets on ``host``: what a pipeline's stages
    offload (see the module's docstring). ``address`` and ``token`` are what a ``SocketSink`` connects
    with. ``timeout``: the deadline of every read once a frame has begun (an idle connection waits for
    its next request as long as the store is open)."""

    def __init__(self, host: str, timeout: float = 300.0) -> None:
        self.token = secrets.token_bytes(16)
        self.timeout = timeout
        self._listeners = listen(host, backlog=64, what="offload")
        self.address = published(host, self._listeners)
        self._lock = threading.Lock()
        self.data: dict[str, list[torch.Tensor]] = {}
        self.bytes = 0
        self.peak_bytes = 0
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._accept, name="offload-store", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self.bytes, "peak_bytes": self.peak_bytes, "bundles": len(self.data)}

    def close(self) -> None:
        """Stop accepting, end every connection, forget every bundle (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self.data.clear()
            self.bytes = 0
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=self.timeout)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for listener in self._listeners:
            listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the store's threads ----------------------------------------------------------------------

    def _accept(self) -> None:
        poll = select.poll()
        poll.register(self._wake_r, select.POLLIN)
        for listener in self._listeners:
            listener.setblocking(False)
            poll.register(listener.fileno(), select.POLLIN)
        while True:
            ready = poll.poll()  # the store's own life: close() wakes it
            if self._closed:
                return
            for fd, _ in ready:
                found = [x for x in self._listeners if x.fileno() == fd]
                if not found:
                    continue
                try:
                    sock, _ = found[0].accept()
                except (BlockingIOError, InterruptedError):
                    continue
                sock.setblocking(True)
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    if self._closed:
                        sock.close()
                        return
                    self._conns.add(sock)
                threading.Thread(target=self._serve, args=(sock,), name="offload-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        why = "closed by the stage"
        try:
            sock.settimeout(self.timeout)
            hello = bytearray(HELLO.size)
            fill(sock, memoryview(hello))
            magic, token = HELLO.unpack(hello)
            if magic != HELLO_MAGIC or not hmac.compare_digest(token, self.token):
                sock.sendall(ANSWER.pack(ANSWER_MAGIC, REFUSED, 0, 0))
                why = "refused: not the store's token"
                return
            sock.sendall(ANSWER.pack(ANSWER_MAGIC, OK, 0, 0))
            head = bytearray(REQUEST.size)
            while True:
                try:
                    fill(sock, memoryview(head), idle=lambda: not self._closed)
                except Torn as e:
                    if e.got == 0 and e.why == "connection closed":
                        return  # the stage closed its connection between requests
                    raise
                self._request(sock, *REQUEST.unpack(head))
        except (Torn, OSError, ValueError) as e:
            why = str(e)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()
            if not self._closed and why != "closed by the stage":
                log.warning("offload store: a stage's connection ended: %s", why)

    def _request(self, sock: socket.socket, magic: int, op: int, name_len: int, parts: int, payload: int) -> None:
        if magic != REQUEST_MAGIC or op not in OPS:
            raise ValueError(f"not a request (magic {magic:#x}, op {op})")
        if name_len > MAX_NAME or parts > MAX_PARTS:
            raise ValueError(f"a {OPS[op]} of {parts} parts named by {name_len} bytes: over the limits "
                             f"({MAX_PARTS}, {MAX_NAME})")
        raw = bytearray(name_len + parts * PART.size)
        fill(sock, memoryview(raw))
        name = raw[:name_len].decode("utf-8", errors="replace")
        sizes = [PART.unpack_from(raw, name_len + i * PART.size)[0] for i in range(parts)]
        if sum(sizes) != (payload if op == PUT else 0):
            raise ValueError(f"a {OPS[op]} of {name!r}: its {parts} parts add up to {sum(sizes)} bytes, its frame "
                             f"says {payload}")
        if op == PUT:
            tensors = [_empty(n) for n in sizes]
            for view in _views(tensors):
                fill(sock, view)
            with self._lock:
                old = self.data.pop(name, None)
                self.data[name] = tensors
                self.bytes += payload - (sum(t.numel() for t in old) if old else 0)
                self.peak_bytes = max(self.peak_bytes, self.bytes)
            sock.sendall(ANSWER.pack(ANSWER_MAGIC, OK, 0, 0))
        elif op == GET:
            with self._lock:
                found = self.data.get(name)
            if found is None:
                msg = f"no bundle {name!r} in the store".encode()
                send(sock, [ANSWER.pack(ANSWER_MAGIC, NOT_FOUND, 0, len(msg)), msg])
                return
            sizes_out = b"".join(PART.pack(t.numel()) for t in found)
            send(sock, [ANSWER.pack(ANSWER_MAGIC, OK, len(found), sum(t.numel() for t in found)), sizes_out,
                        *_views(found)])
        else:
            with self._lock:
                old = self.data.pop(name, None)
                if old is not None:
                    self.bytes -= sum(t.numel() for t in old)
            sock.sendall(ANSWER.pack(ANSWER_MAGIC, OK, 0, 0))


class SocketSink:
    """A stage's side of a ``ByteStore``: the ``Sink`` of worker/pipeline/offload.py. ``endpoint()`` gives
    the store's address and token (asked once, on first use); ``host``: this process's address (a store
    on the same host is reached over its Unix socket). Calls are made by one background thread in the
    order asked; ``put`` and ``drop`` return at once (their errors are raised by a later call), ``get``
    waits for its ``prefetch`` (made now if none was) at most ``timeout`` seconds."""

    def __init__(self, endpoint: Callable[[], tuple[str, bytes]], host: str, timeout: float = 300.0) -> None:
        self._endpoint, self.host, self.timeout = endpoint, host, timeout
        self.where = "the offload store"
        self._sock: socket.socket | None = None
        self._calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload")
        self._fetching: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}
        self._sent: list[concurrent.futures.Future[None]] = []
        self._meta: dict[str, list[Meta]] = {}

    # -- Sink ----------------------------------------------------------------------------------

    def put(self, group: str, values: dict[str, Any]) -> None:
        self._check()
        meta: list[Meta] = []
        tensors: list[torch.Tensor] = []
        for key, value in values.items():
            if not (isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], torch.Tensor)):
                raise TypeError(f"offload: {group}/{key} is {type(value).__name__}, not an encoded tensor "
                                f"(tensor, dtype, device)")
            data, dtype, device = value
            if data.device.type != "cpu":
                raise ValueError(f"offload: {group}/{key} is on {data.device}; the store takes CPU tensors")
            data = data.contiguous()
            meta.append((key, data.dtype, tuple(data.shape), dtype, device))
            tensors.append(data)
        self._meta[group] = meta
        self._sent.append(self._calls.submit(self._put, group, tensors))

    def prefetch(self, group: str) -> None:
        if group not in self._fetching:
            self._fetching[group] = self._calls.submit(self._get, group)

    def get(self, group: str) -> dict[str, Any]:
        self.prefetch(group)
        try:
            out = self._fetching.pop(group).result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise OffloadError(f"offload: {group} did not come back from {self.where} within "
                               f"{self.timeout:g}s") from None
        self._check()
        return out

    def drop(self, group: str) -> None:
        self._fetching.pop(group, None)
        self._meta.pop(group, None)
        self._sent.append(self._calls.submit(self._drop, group))

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every put and drop asked so far (at most ``timeout`` seconds, the sink's own by
        default) and raise the first error among them: a step ends with its bundles stored or dropped."""
        pending, self._sent = self._sent, []
        done, late = concurrent.futures.wait(pending, timeout=self.timeout if timeout is None else timeout)
        if late:
            self._sent = list(late)
            raise OffloadError(f"offload: {len(late)} puts and drops still under way with {self.where} after "
                               f"{self.timeout if timeout is None else timeout:g}s")
        for f in pending:
            f.result()

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # -- the background thread ----------------------------------------------------------------

    def _check(self) -> None:
        """Raise what a put or drop made in the background raised."""
        done = [f for f in self._sent if f.done()]
        self._sent = [f for f in self._sent if not f.done()]
        for f in done:
            f.result()

    def _conn(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        addr, token = self._endpoint()
        self.where = f"the offload store at {addr.split('|', 1)[0]}:{addr.split('|')[1]}"
        deadline = time.monotonic() + self.timeout
        try:
            sock = connect(addr, self.host, deadline)
            sock.settimeout(self.timeout)
            sock.sendall(HELLO.pack(HELLO_MAGIC, token))
            status = self._answer(sock, "hello")[1]
        except (OSError, Torn) as e:
            raise OffloadError(f"offload: cannot reach {self.where}: {e}") from None
        if status != OK:
            sock.close()
            raise OffloadError(f"offload: {self.where} refused this stage's greeting (not its token)")
        self._sock = sock
        return sock

    def _answer(self, sock: socket.socket, what: str) -> tuple[int, int, int, int]:
        head = bytearray(ANSWER.size)
        fill(sock, memoryview(head))
        magic, status, parts, payload = ANSWER.unpack(head)
        if magic != ANSWER_MAGIC:
            raise Torn(len(head), f"{what}: not an answer (magic {magic:#x})")
        return magic, status, parts, payload

    def _call(self, op: int, group: str, tensors: Sequence[torch.Tensor] = ()) -> tuple[int, int, int]:
        """Send one request; its answer's status, parts and payload bytes (read no further)."""
        sock = self._conn()
        name = group.encode()
        sizes = b"".join(PART.pack(t.numel() * t.element_size()) for t in tensors)
        payload = sum(t.numel() * t.element_size() for t in tensors)
        try:
            send(sock, [REQUEST.pack(REQUEST_MAGIC, op, len(name), len(tensors), payload), name, sizes,
                        *_views(tensors)])
            _, status, parts, nbytes = self._answer(sock, f"{OPS[op]} {group}")
        except (OSError, Torn) as e:
            self._lost()
            raise OffloadError(f"offload: {OPS[op]} of {group} failed ({self.where}): {e}") from None
        return status, parts, nbytes

    def _lost(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _refused(self, op: int, group: str, status: int, nbytes: int) -> OffloadError:
        assert self._sock is not None
        msg = bytearray(min(nbytes, 1 << 16))
        try:
            fill(self._sock, memoryview(msg))
        except (OSError, Torn):
            self._lost()
        return OffloadError(f"offload: {OPS[op]} of {group} refused by {self.where} (status {status}): "
                            f"{msg.decode(errors='replace')}")

    def _put(self, group: str, tensors: list[torch.Tensor]) -> None:
        status, _, nbytes = self._call(PUT, group, tensors)
        if status != OK:
            raise self._refused(PUT, group, status, nbytes)

    def _drop(self, group: str) -> None:
        status, _, nbytes = self._call(DROP, group)
        if status != OK:
            raise self._refused(DROP, group, status, nbytes)

    def _get(self, group: str) -> dict[str, Any]:
        meta = self._meta.get(group)
        if meta is None:
            raise OffloadError(f"offload: {group} was never put (or was dropped)")
        status, parts, nbytes = self._call(GET, group)
        if status != OK:
            raise self._refused(GET, group, status, nbytes)
        sock = self._sock
        assert sock is not None
        try:
            raw = bytearray(parts * PART.size)
            fill(sock, memoryview(raw))
            sizes = [PART.unpack_from(raw, i * PART.size)[0] for i in range(parts)]
            out: dict[str, Any] = {}
            tensors = []
            for key, stored, shape, dtype, device in meta:
                t = torch.empty(shape, dtype=stored)
                tensors.append(t)
                out[key] = (t, dtype, device)
            expected = [t.numel() * t.element_size() for t in tensors]
            if sizes != expected:
                self._lost()
                raise OffloadError(f"offload: {group} came back from {self.where} as {parts} parts of {sizes} "
                                   f"bytes; {len(meta)} parts of {expected} bytes were put")
            for view in _views(tensors):
                fill(sock, view)
        except (OSError, Torn) as e:
            self._lost()
            raise OffloadError(f"offload: get of {group} failed ({self.where}): {e}") from None
        return out
