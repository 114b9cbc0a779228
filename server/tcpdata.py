"""The shard's side of the TCP bulk path (protos/tcpdata.py): a data port, one connection per worker.

``TcpData(host)`` listens beside the gRPC port. Register gives each worker a
token (``offer``: the port and the token go in the RegisterResponse); the
worker connects, says hello with it and the sizes of its buffers, and gets
an ACK once its connection serves (a later connection of the same worker
replaces it). Each connection has a push buffer, filled by its
``Receiver`` from the worker's frames, and a pull buffer.

``SegmentCache`` (server/shm.py) hands the names ``tcp-<seq>`` here: a
Push's chunk is ``view``: the bytes of its frame once they are in (waited
for up to the worker's deadline; a torn, missing or wrong-sized frame is
INVALID_ARGUMENT naming the tensor, the bytes expected and received, and
the Push changes nothing); a Pull gets a ``PullSegment`` over the pull
buffer, which the shard's weights are copied into as for shared memory,
then sent in one frame (``flush``) before the answers go.

Thread-safety: every method may be called from any thread. ``close`` ends
every connection and joins every thread this module started.
"""

from __future__ import annotations

import logging
import mmap
import secrets
import socket
import threading
from collections.abc import Callable

from shardps.protos import shm, tcpdata
from shardps.server.errors import InvalidArgument

log = logging.getLogger("shardps.server")

MAX_BUFFER = 1 << 40  # a hello asking more is refused (buffers are reserved lazily, page by page)


class PullSegment(shm.Segment):
    """One Pull's view of a connection's pull buffer: remembers how far it was written, then ``flush``."""

    def __init__(self, conn: Conn, name: str, seq: int) -> None:
        super().__init__(name, conn.pull_size, conn.pull_mm, owner=False)
        self.conn, self.seq, self.used = conn, seq, 0

    def view(self, offset: int, nbytes: int) -> memoryview:
        out = super().view(offset, nbytes)
        self.used = max(self.used, offset + nbytes)
        return out

    def flush(self) -> None:
        """Send what was written, in one frame (before the answers that name it go)."""
        try:
            tcpdata.send_frame(self.conn.sock, self.conn.send_lock, self.seq, 0,
                               memoryview(self.conn.pull_mm)[: self.used])
        except OSError as e:
            self.conn.close()
            raise InvalidArgument(f"Pull: the data connection of worker {self.conn.worker_id} failed while "
                                  f"sending {self.used} bytes ({e})") from None


class Conn:
    """One worker's data connection: its buffers and the thread that fills the push buffer."""

    def __init__(self, worker_id: int, sock: socket.socket, push_size: int, pull_size: int, timeout: float,
                 counted: Callable[[int], None] | None = None) -> None:
        self.worker_id, self.sock, self.timeout = worker_id, sock, timeout
        self.push_mm = mmap.mmap(-1, max(1, push_size))
        self.pull_size = max(1, pull_size)
        self.pull_mm = mmap.mmap(-1, self.pull_size)
        self.send_lock = threading.Lock()
        # Once the reading ends (a torn or bad frame, the worker went) the socket closes: the worker's path
        # goes off. The connection stays until replaced, so that a Push naming it learns why.
        self.receiver = tcpdata.Receiver(sock, memoryview(self.push_mm)[:push_size], f"w{worker_id}",
                                         on_end=lambda why: self.receiver.close(), counted=counted)

    def close(self) -> None:
        self.receiver.close()
        for mm in (self.push_mm, self.pull_mm):
            try:
                mm.close()
            except BufferError:  # a view still held (a chunk being read): it goes with the last one
                pass


class TcpData:
    """The data port of one shard (module docstring)."""

    def __init__(self, host: str, received: Callable[[int], None] | None = None) -> None:
        """``received(nbytes)``: each frame's bytes as they came (a Push's, as ``Job.received`` counts its
        messages)."""
        self._received = received
        self._lock = threading.Lock()
        self._tokens: dict[int, bytes] = {}  # worker -> the token its latest Register was given
        self._conns: dict[int, Conn] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host.strip("[]"), 0))
            self._listener.listen(64)
        except BaseException:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept, name=f"shardps-tcp-accept-{self.port}", daemon=True)
        self._accepting.start()

    def offer(self, worker_id: int) -> tuple[int, bytes]:
        """The port and a new token for ``worker_id``'s data connection (its Register)."""
        token = secrets.token_bytes(16)
        with self._lock:
            self._tokens[worker_id] = token
        return self.port, token

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            t = threading.Thread(target=self._hello, args=(sock,), name="shardps-tcp-hello", daemon=True)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._threads = {x for x in self._threads if x.is_alive()}
                self._threads.add(t)
            t.start()

    def _hello(self, sock: socket.socket) -> None:
        """Check the worker's hello (5 s to say it), make its connection, answer ACK, then read its frames."""
        try:
            tcpdata.tune(sock, 5.0)
            head = bytearray(tcpdata.HELLO.size)
            tcpdata.fill(sock, memoryview(head))
            magic, token, push_size, pull_size, timeout = tcpdata.HELLO.unpack(head)
            with self._lock:
                worker = next((w for w, t in self._tokens.items() if secrets.compare_digest(t, token)), None)
                if worker is not None:
                    del self._tokens[worker]
            if magic != tcpdata.HELLO_MAGIC or worker is None or max(push_size, pull_size) > MAX_BUFFER \
                    or not 0 < timeout <= 86400:
                log.warning("a data connection said no valid hello: closed")
                sock.close()
                return
            sock.settimeout(timeout)
            conn = Conn(worker, sock, push_size, pull_size, timeout, self._received)
        except (OSError, tcpdata.Torn) as e:
            log.warning("a data connection failed before its hello (%s): closed", e)
            sock.close()
            return
        with self._lock:
            old = self._conns.get(worker)
            self._conns[worker] = conn
            closed = self._closed
        if old is not None:
            old.close()
        if closed:
            conn.close()
            return
        try:
            sock.sendall(tcpdata.ACK.pack(tcpdata.ACK_MAGIC, 0))
        except OSError:
            self._drop(worker, conn)
            return
        conn.receiver.start()

    def _drop(self, worker_id: int, conn: Conn) -> None:
        with self._lock:
            if self._conns.get(worker_id) is conn:
                del self._conns[worker_id]
        conn.close()

    def _conn(self, worker_id: int, name: str) -> tuple[Conn, int]:
        try:
            seq = tcpdata.parse_name(name)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        with self._lock:
            conn = self._conns.get(worker_id)
        if conn is None:
            raise InvalidArgument(f"data segment {name!r}: worker {worker_id} has no data connection here")
        return conn, seq

    def view(self, worker_id: int, name: str, offset: int, nbytes: int, tensor: str = "") -> memoryview:
        """A Push chunk's bytes, once its frame came whole (module docstring)."""
        conn, seq = self._conn(worker_id, name)
        if nbytes == 0:  # an empty part has no frame
            return memoryview(b"")
        try:
            return conn.receiver.wait(seq, offset, nbytes, conn.timeout)
        except tcpdata.DataError as e:
            raise InvalidArgument(f"tensor {tensor!r}: {e}" if tensor else str(e)) from None

    def pull_segment(self, worker_id: int, name: str) -> PullSegment:
        conn, seq = self._conn(worker_id, name)
        return PullSegment(conn, name, seq)

    def forget(self, worker_id: int) -> None:
        """Close the connection of a worker that left."""
        with self._lock:
            conn = self._conns.pop(worker_id, None)
            self._tokens.pop(worker_id, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Stop listening, close every connection, join every thread. Idempotent."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
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
