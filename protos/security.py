"""TLS, mutual TLS and bearer tokens for every gRPC channel, both sides.

``Security`` gathers the settings: ``tls_cert``/``tls_key`` (a server's
identity, or a client's for mutual TLS), ``tls_ca`` (the CA that signed the
other side: a client checks servers with it; a server given one requires
and checks client certificates), and ``token`` (a bearer token sent in the
``authorization`` metadata and checked by the server in constant time).

Configuration order: explicit arguments, then the environment
(``SHARDPS_TLS_CERT``, ``SHARDPS_TLS_KEY``, ``SHARDPS_TLS_CA``,
``SHARDPS_TLS_SERVER_NAME``, ``SHARDPS_AUTH_TOKEN`` or
``SHARDPS_AUTH_TOKEN_FILE``), then off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from shardps.protos import env

AUTH_HEADER = "authorization"


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

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("the auth token must be non-empty and hold no whitespace")

    @classmethod
    def from_env(cls, *, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 server_name: str | None = None) -> Security:
        """Arguments first, then SHARDPS_* environment variables, then off."""
        if token is None:
            token_file = token_file or env.get(env.AUTH_TOKEN_FILE)
            token = read_token_file(token_file) if token_file else env.get(env.AUTH_TOKEN)
        return cls(tls_cert=tls_cert or env.get(env.TLS_CERT), tls_key=tls_key or env.get(env.TLS_KEY),
                   tls_ca=tls_ca or env.get(env.TLS_CA), token=token,
                   server_name=server_name or env.get(env.TLS_SERVER_NAME))

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

    # -- client side ---------------------------------------------------------

    def channel(self, address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
        opts = list(options or [])
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        if not self.tls:
            if self.token:
                # Tokens over plaintext: only for loopback and tests; grpc refuses call
                # credentials on insecure channels, so send the header by interceptor.
                return grpc.intercept_channel(grpc.insecure_channel(address, options=opts),
                                              TokenInterceptor(self.token))
            return grpc.insecure_channel(address, options=opts)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "TLS CA"),
            private_key=_read(self.tls_key, "TLS key"), certificate_chain=_read(self.tls_cert, "TLS certificate"))
        if self.token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self.token))
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
