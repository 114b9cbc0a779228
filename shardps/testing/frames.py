"""Push and Pull by hand as a data connection's frames: what tests and the fuzzer send where a worker would.

``FrameStub(address)`` stands where a gRPC stub of ``Workers`` stood for Push and Pull (they are frames
only): ``Push(requests, timeout)`` sends the PushRequests (messages, or their bytes as they are, parsed or
not) as one frame and returns the PushResponse; ``Pull(request, timeout)`` sends a PullRequest and returns
its PullResponses (the bytes in them: it asks for no segment unless the request names one). A refusal
raises the frame's status as a ``grpc.RpcError`` (``code()``, ``details()``), as the gRPC call did. Every
other ``Workers`` method is the gRPC stub's, over the stub's channel.

The connection is the one a worker of the request's ``worker_id`` would make: the shard's
``Workers.Connect`` answer gives the data port, the worker's token and the shard's route; one connection
per worker id, made on first use (a request that does not parse is sent as worker 0's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardps.protos import dataconn as wire
from shardps.protos import framing
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.worker.datapath.dataconn import DataConn


def _worker_of(first: bytes | None, kind: Any) -> int:
    try:
        return int(kind.FromString(first).worker_id) if first else 0
    except Exception:  # noqa: BLE001 - bytes that do not parse: sent as worker 0's, refused by the shard
        return 0


class FrameStub:
    """Push and Pull to the shard at ``address`` as frames (module docstring); ``close`` ends its connections."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        self.address = address
        self.security = security or Security()
        self._channel = self.security.channel(address, role="worker")
        self._conns: dict[int, tuple[DataConn, int]] = {}  # worker id -> its connection and the shard's route

    def _conn(self, worker_id: int, timeout: float) -> tuple[DataConn, int]:
        got = self._conns.get(worker_id)
        if got is None or got[0].error:
            offer = ps_pb2_grpc.WorkersStub(self._channel).Connect(
                ps_pb2.ConnectRequest(worker_id=worker_id), timeout=timeout)
            conn = DataConn.open(self.address.rsplit(":", 1)[0], offer.data_port, offer.data_token, worker_id,
                                 timeout, lambda why: None, self.security)
            got = self._conns[worker_id] = (conn, offer.data_route)
        return got

    def Push(self, requests: Iterable[ps_pb2.PushRequest | bytes], timeout: float) -> ps_pb2.PushResponse:
        msgs = [m if isinstance(m, bytes) else m.SerializeToString() for m in requests]
        conn, route = self._conn(_worker_of(msgs[0] if msgs else None, ps_pb2.PushRequest), timeout)
        ctl, _ = conn.call(wire.PUSH, route, wire.joined(msgs), (), 0, timeout)
        return ps_pb2.PushResponse.FromString(ctl)

    def Pull(self, request: ps_pb2.PullRequest | bytes, timeout: float, buffer_bytes: int = 0) -> list[Any]:
        """``buffer_bytes``: the frame's pull buffer (where a Pull naming the frame's segment is answered); the
        answer's payload is read into one of that size, and not looked at."""
        data = request if isinstance(request, bytes) else request.SerializeToString()
        conn, route = self._conn(_worker_of(data, ps_pb2.PullRequest), timeout)
        into = memoryview(bytearray(buffer_bytes)) if buffer_bytes else None
        ctl, _ = conn.call(wire.PULL, route, (data,), (), buffer_bytes, timeout, into=into)
        return [framing.read_pull_response(m) for m in wire.split(ctl)]

    def __getattr__(self, method: str) -> Any:
        """Every other ``Workers`` RPC (Register, Heartbeat, Connect ...) over the gRPC channel."""
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(ps_pb2_grpc.WorkersStub(self._channel), method)

    def close(self) -> None:
        for conn, _ in self._conns.values():
            conn.close()
        self._conns.clear()
        self._channel.close()

    def __enter__(self) -> FrameStub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

