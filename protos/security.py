"""TLS, mutual TLS and bearer tokens for every gRPC channel, both sides.

``Security`` gathers the settings: ``tls_cert``/``tls_key`` (a server's
identity, or a client's for mutual TLS), ``tls_ca`` (the CA that signed the
other side: a client checks servers with it; a server given one requires
and checks client certificates), and bearer tokens sent in the
``authorization`` metadata and checked by the server in constant time:
``token``, the shared token (every audience), and one per audience (``ROLES``):
``worker_token`` (the ``Workers`` service), ``operator_token``
(``Operator``), ``peer_token`` (``Peers``, server to server). A server
admits each; a client sends the token of its role, or the shared one
(``token_for``, ``channel(address, role=...)``).

Configuration order: explicit arguments, then the environment
(``SHARDPS_TLS_CERT``, ``SHARDPS_TLS_KEY``, ``SHARDPS_TLS_CA``,
``SHARDPS_TLS_SERVER_NAME``, ``SHARDPS_AUTH_TOKEN`` or
``SHARDPS_AUTH_TOKEN_FILE``, ``SHARDPS_WORKER_TOKEN`` or
``SHARDPS_WORKER_TOKEN_FILE``, the same for ``OPERATOR`` and ``PEER``), then off.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from shardps.protos import env

AUTH_HEADER = "authorization"
#: The audiences with a token of their own: workers, operators, servers (peers).
ROLES = ("worker", "operator", "peer")
#: Seconds without a frame after which a channel pings its server (``SHARDPS_KEEPALIVE_S``; 0: never). No
#: answer within half of that and the connection is given up, calls in flight or not: a link gone silent (cut,
#: a host gone without a reset) becomes UNAVAILABLE for the calls on it, not a wait that only their deadline
#: ends. A lost connection is retried after at most 2 s (gRPC's default grows to 120 s), so a healed link
#: carries again within seconds.
KEEPALIVE_S = 10.0
#: What a server needs to accept those pings (by default it sends GOAWAY to a client that pings more often
#: than every 5 minutes without data).
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def keepalive_seconds() -> float:
    """``SHARDPS_KEEPALIVE_S`` (default ``KEEPALIVE_S``); ValueError naming the variable for a value that is not
    a number >= 0."""
    raw = env.get(env.KEEPALIVE_S)
    try:
        seconds = KEEPALIVE_S if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"{env.KEEPALIVE_S}={raw!r} is not a number of seconds") from None
    if not seconds >= 0:
        raise ValueError(f"{env.KEEPALIVE_S}={raw!r}: expected seconds >= 0 (0: no pings)")
    return seconds


def keepalive_options() -> list[tuple[str, int]]:
    """The channel options for ``SHARDPS_KEEPALIVE_S`` (default ``KEEPALIVE_S``): pings, and the reconnect
    backoff. ValueError naming the variable for a value that is not a number >= 0."""
    seconds = keepalive_seconds()
    opts = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2_000)]
    if seconds > 0:
        ms = max(1, int(seconds * 1000))
        opts += [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", max(1, ms // 2)),
                 ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    return opts


_ROLE_ENV = {"worker": (env.WORKER_TOKEN, env.WORKER_TOKEN_FILE),
             "operator": (env.OPERATOR_TOKEN, env.OPERATOR_TOKEN_FILE),
             "peer": (env.PEER_TOKEN, env.PEER_TOKEN_FILE)}


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None


def read_token_file(path: str) -> str:
    token = (_read(path, "token file") or b"").decode().strip()
    if not token:
        raise ValueError(f"token file {path!r} is empty")
    return token


@dataclass(frozen=True)
class Security:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    token: str | None = None
    #: For clients: the name the server certificate must carry, when it is
    #: not the host in the address (e.g. a certificate for "shardps-server").
    server_name: str | None = None
    #: A token per audience: a server admits each to its own service only; a
    #: client of that role sends it (falling back to ``token``).
    worker_token: str | None = None
    operator_token: str | None = None
    peer_token: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        for what, t in (("auth token", self.token), *((f"{r} token", self.role_tokens[r]) for r in ROLES)):
            if t is not None and (not t or any(c.isspace() for c in t)):
                raise ValueError(f"the {what} must be non-empty and hold no whitespace")

    @classmethod
    def from_env(cls, *, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                 token: str | None = None, token_file: str | None = None, server_name: str | None = None,
                 worker_token_file: str | None = None, operator_token_file: str | None = None,
                 peer_token_file: str | None = None) -> Security:
        """Arguments first, then SHARDPS_* environment variables, then off (each token on its own)."""
        if token is None:
            token_file = token_file or env.get(env.AUTH_TOKEN_FILE)
            token = read_token_file(token_file) if token_file else env.get(env.AUTH_TOKEN)
        files = {"worker": worker_token_file, "operator": operator_token_file, "peer": peer_token_file}
        roles: dict[str, str | None] = {}
        for role, (var, file_var) in _ROLE_ENV.items():
            path = files[role] or env.get(file_var)
            roles[f"{role}_token"] = read_token_file(path) if path else env.get(var)
        return cls(tls_cert=tls_cert or env.get(env.TLS_CERT), tls_key=tls_key or env.get(env.TLS_KEY),
                   tls_ca=tls_ca or env.get(env.TLS_CA), token=token,
                   server_name=server_name or env.get(env.TLS_SERVER_NAME), **roles)

    @property
    def role_tokens(self) -> dict[str, str | None]:
        """The token of each audience (``ROLES``), None where none is set."""
        return {"worker": self.worker_token, "operator": self.operator_token, "peer": self.peer_token}

    @property
    def any_token(self) -> bool:
        """Whether a server with these settings checks tokens."""
        return bool(self.token or any(self.role_tokens.values()))

    def token_for(self, role: str | None) -> str | None:
        """The token a client of ``role`` sends: its audience's, else the shared one (None: no token)."""
        if role is not None and role not in ROLES:
            raise ValueError(f"no audience {role!r}: one of {ROLES}")
        return (self.role_tokens[role] if role else None) or self.token

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    def describe(self) -> str:
        parts = []
        if self.tls_cert and self.tls_ca:
            parts.append("mutual TLS")
        elif self.tls:
            parts.append("TLS")
        if self.token:
            parts.append("token")
        roles = [r for r in ROLES if self.role_tokens[r]]
        if roles:
            parts.append(f"{'/'.join(roles)} tokens")
        return " + ".join(parts) or "insecure"

    # -- server side ---------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None for an insecure port; with a CA, client certificates are required."""
        if not self.tls_cert:
            if self.tls_ca:
                raise ValueError("a server needs tls_cert and tls_key to serve TLS (tls_ca alone is for clients)")
            return None
        cert, key = _read(self.tls_cert, "TLS certificate"), _read(self.tls_key, "TLS key")
        if cert is None or key is None:
            raise ValueError("a server needs tls_key with tls_cert to serve TLS")
        ca = _read(self.tls_ca, "TLS CA")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The data connection's TLS as the gRPC port's (``server_credentials``): this identity, and with a CA
        a client certificate required; None without TLS."""
        if not self.tls_cert:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_ca:
            ctx.load_verify_locations(self.tls_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    # -- client side ---------------------------------------------------------

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """The data connection's TLS as a channel's (``channel``): the server checked against ``tls_ca`` (the
        system's CAs without one) under ``server_name`` or its host, this client's certificate where given;
        None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else ssl.create_default_context()
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def channel(self, address: str, options: list[tuple[str, object]] | None = None, *,
                role: str | None = None) -> grpc.Channel:
        """A channel to ``address`` sending the token of ``role`` (``token_for``; None: the shared token)."""
        token = self.token_for(role)
        opts = [*keepalive_options(), *(options or [])]
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        if not self.tls:
            if token:
                # Tokens over plaintext: only for loopback and tests; grpc refuses call
                # credentials on insecure channels, so send the header by interceptor.
                return grpc.intercept_channel(grpc.insecure_channel(address, options=opts),
                                              TokenInterceptor(token))
            return grpc.insecure_channel(address, options=opts)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "TLS CA"),
            private_key=_read(self.tls_key, "TLS key"), certificate_chain=_read(self.tls_cert, "TLS certificate"))
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(address, creds, options=opts)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str | bytes]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = tuple(metadata)
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header: tuple[str, str | bytes] = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d, list(d.metadata or []) + [self._header])

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)
