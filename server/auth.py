"""Bearer-token authentication per audience: a server interceptor.

Every RPC but the health check must carry ``authorization: Bearer <token>``.
Each service of ps.proto has one audience (``AUDIENCES``): ``Workers`` the
workers, ``Operator`` the operators, ``Peers`` the other servers. A server
knows up to four tokens: one per audience (``--worker-token-file``,
``--operator-token-file``, ``--peer-token-file`` or their variables), each
admitted to its own audience's service only, and the shared token
(``SHARDPS_AUTH_TOKEN``, ``--token-file``), admitted everywhere.

- no token, or one the server does not know: UNAUTHENTICATED;
- a known token on a service of another audience: PERMISSION_DENIED, naming
  the method and the audience it needs.

Either way the refusal comes before any handler runs, so it changes
nothing. Tokens are compared in constant time (``hmac.compare_digest``),
each against every known token.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from shardps.protos.security import AUTH_HEADER, ROLES

log = logging.getLogger("shardps.server")

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # health checks need no token

#: Which audience each service of ps.proto is for.
AUDIENCES = {"shardps.v1.Workers": "worker", "shardps.v1.Operator": "operator", "shardps.v1.Peers": "peer",
             "shardps.v1.Rows": "worker", "shardps.v1.Experts": "worker"}
#: Where each audience's token comes from (in refusals).
TOKEN_SOURCES = {
    "worker": "the worker token (SHARDPS_WORKER_TOKEN, --worker-token-file)",
    "operator": "the operator token (SHARDPS_OPERATOR_TOKEN, --operator-token-file)",
    "peer": "the peer token (SHARDPS_PEER_TOKEN, --peer-token-file)",
}


def audience_of(method: str) -> str | None:
    """The audience of a full method name ``/package.Service/Method`` (None for a service of no audience)."""
    return AUDIENCES.get(method.lstrip("/").split("/", 1)[0])


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """``token``: the shared token (every audience); ``tokens``: a token per audience (``ROLES``).

    A method of no audience (none of ps.proto's services) admits the shared token only.
    """

    def __init__(self, token: str | None = None, on_reject: Callable[[str, str], None] | None = None, *,
                 tokens: Mapping[str, str | None] | None = None) -> None:
        known: list[tuple[bytes, frozenset[str]]] = []
        if token:
            known.append((f"Bearer {token}".encode(), frozenset((*ROLES, "*"))))
        for role, t in (tokens or {}).items():
            if role not in ROLES:
                raise ValueError(f"no audience {role!r}: one of {ROLES}")
            if t:
                known.append((f"Bearer {t}".encode(), frozenset((role,))))
        if not known:
            raise ValueError("empty auth token")
        self._known = known
        self._on_reject = on_reject

    def _admits(self, given: bytes) -> frozenset[str] | None:
        """The audiences ``given`` is admitted to (None: not a token this server knows)."""
        found: frozenset[str] | None = None
        for expected, audiences in self._known:  # every one compared: the time does not tell which matched
            if hmac.compare_digest(given, expected):
                found = audiences if found is None else found | audiences
        return found

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
        audiences = self._admits(given)
        audience = audience_of(method)
        if audiences is not None and (audience or "*") in audiences:
            return continuation(handler_call_details)
        if audiences is None:
            why = "missing" if not given else "wrong"
            log.warning("refused %s: %s auth token", method, why)
            code, message = grpc.StatusCode.UNAUTHENTICATED, (
                f"{why} auth token: send 'authorization: Bearer <token>' (SHARDPS_AUTH_TOKEN or --token-file, "
                f"or the token of your audience)")
        else:
            held = ", ".join(sorted(audiences))
            needs = TOKEN_SOURCES[audience] if audience else "the shared token (SHARDPS_AUTH_TOKEN, --token-file)"
            log.warning("refused %s: a %s token, for another audience", method, held)
            code, message = grpc.StatusCode.PERMISSION_DENIED, (
                f"{method} is for the {audience or 'no'} audience: this token is the {held} token; "
                f"send {needs} or the shared token")
        if self._on_reject is not None:
            self._on_reject(method, code.name)
        return _deny(continuation(handler_call_details), code, message)


def _deny(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same kind that aborts with ``code``."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
