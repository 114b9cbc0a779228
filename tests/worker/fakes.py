"""Fake gRPC channels for the worker's tests: each call goes to a function of (address, method, request)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardps.protos.security import Security
from shardps.worker.datapath.dataconn import FrameError
from shardps.worker.datapath.transport import Transport

Failure = FrameError  # a failed call as the transport reads it: code() and details(), as gRPC's


Server = Callable[[str, str, Any], Any]


class FakeChannel:
    def __init__(self, address: str, server: Server) -> None:
        self.address, self.server, self.closed = address, server, False

    def _method(self, path: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        name = path.rsplit("/", 1)[1]
        return lambda request, timeout=None, **kw: self.server(self.address, name, request)

    unary_unary = unary_stream = stream_unary = stream_stream = _method

    def close(self) -> None:
        self.closed = True


class FakeSecurity(Security):
    """Security whose channels are fakes served by ``server``."""

    def channel(self, address: str, options: Any = None, *, role: str | None = None) -> Any:  # type: ignore[override]
        ch = FakeChannel(address, SERVERS[id(self)])
        OPENED.setdefault(id(self), []).append(ch)
        return ch


SERVERS: dict[int, Server] = {}
OPENED: dict[int, list[FakeChannel]] = {}


def fake_transport(server: Server, addresses=("a:1", "b:1"), **kw: Any) -> Transport:
    sec = FakeSecurity()
    SERVERS[id(sec)] = server
    kw.setdefault("timeout", 5.0)
    kw.setdefault("recovery_timeout", 0.3)
    return Transport(list(addresses), security=sec, **kw)
