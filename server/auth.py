"""Bearer-token authentication: a server interceptor.

Every RPC but the health check must carry ``authorization: Bearer <token>``;
the token is compared in constant time (``hmac.compare_digest``). A missing
or wrong token is answered UNAUTHENTICATED before any handler runs, so it
changes nothing.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import grpc

from shardps.protos.security import AUTH_HEADER

log = logging.getLogger("shardps.server")

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # health checks need no token


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None) -> None:
        if not token:
            raise ValueError("empty auth token")
        self._expected = f"Bearer {token}".encode()
        self._on_reject = on_reject

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        if method.startswith(OPEN_METHODS):
            return continuation(handler_call_details)
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_HEADER:
                given = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        why = "missing" if not given else "wrong"
        log.warning("refused %s: %s auth token", method, why)
        if self._on_reject is not None:
            self._on_reject(method)
        handler = continuation(handler_call_details)
        return _deny(handler, f"{why} auth token: send 'authorization: Bearer <token>' "
                              f"(SHARDPS_AUTH_TOKEN or --token-file)")


def _deny(handler: Any, message: str) -> Any:
    """A handler of the same kind that aborts with UNAUTHENTICATED."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
