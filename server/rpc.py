"""How a servicer method meets gRPC: malformed requests refused, store errors answered as their status.

``unary_errors`` and ``stream_errors`` wrap a handler so that a ``StoreError``
(server/errors.py) becomes ``context.abort`` with its status code and
message (counted in the servicer's metrics); ``safe_deserializer`` hands
over bytes that do not parse as a ``Malformed``, refused by ``checked``.
Shared by every servicer (server/service.py, server/rows/service.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from shardps.server.errors import InvalidArgument, StoreError

F = TypeVar("F", bound=Callable[..., Any])


def status_code(err: StoreError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.code, grpc.StatusCode.INTERNAL)


MAX_DETAILS = 2000  # error messages echo request fields: keep them well under gRPC's metadata limits


class Malformed:
    """What the request deserializers hand over for bytes that do not parse (never an exception:
    gRPC would answer INTERNAL, and in a stream silently stop, applying what came before)."""

    def __init__(self, method: str, error: Exception) -> None:
        self.message = f"{method}: the request does not parse as a protobuf message: {error}"


def safe_deserializer(method: str, deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - any parse failure becomes INVALID_ARGUMENT in the handler
            return Malformed(method, e)

    return parse


def checked(request: Any) -> Any:
    """The request, or for a stream an iterator that refuses malformed messages as they come."""
    if isinstance(request, Malformed):
        raise InvalidArgument(request.message)
    if hasattr(request, "__next__"):
        def messages() -> Iterator[Any]:
            for m in request:
                if isinstance(m, Malformed):
                    raise InvalidArgument(m.message)
                yield m
        return messages()
    return request


def details(e: StoreError) -> str:
    text = str(e)
    return text if len(text) <= MAX_DETAILS else text[: MAX_DETAILS - 20] + " ... (truncated)"


def unary_errors(fn: F, method: str = "") -> F:
    """``fn`` answering a StoreError with its status (and counting it under ``method``, else fn's name)."""
    name = method or fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, checked(request), context)
        except StoreError as e:
            if self.metrics is not None:
                self.metrics.rpc_error(name, e.code)
            context.abort(status_code(e), details(e))

    return wrapper  # type: ignore[return-value]


def stream_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, checked(request), context)
        except StoreError as e:
            if self.metrics is not None:
                self.metrics.rpc_error(fn.__name__, e.code)
            context.abort(status_code(e), details(e))

    return wrapper  # type: ignore[return-value]
