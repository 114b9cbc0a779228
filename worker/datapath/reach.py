"""Reaching a server: its gRPC health check, and what a failed connection means for this client's settings.

Light on purpose (grpc and the health stubs, no torch): ``shardps health`` runs it as a container's
healthcheck every few seconds (deploy/docker-compose.yml), so it must not pay for importing the rest.
worker/datapath/transport.py uses the same functions.
"""

from __future__ import annotations

import sys
from typing import TextIO

import grpc

from shardps.protos.security import Security
from shardps.worker.errors import ShardError, shard_error


def explain_unreachable(security: Security, details: str) -> str:
    """What a failed connection's gRPC details mean for this client's settings ("" if nothing to add).

    gRPC reports a refused TLS handshake in words of its transport ("Socket
    closed", "Hostname Verification Check failed"); this names the cause
    and the setting that fixes it.
    """
    d = details
    if "Hostname Verification" in d or "No match found for server name" in d:
        name = security.server_name or "the host in its address"
        return (f"TLS handshake failed: the server's certificate does not carry {name}; pass the name it carries "
                f"as server_name (--server-name, SHARDPS_TLS_SERVER_NAME)")
    if "CERTIFICATE_VERIFY_FAILED" in d:
        return ("TLS handshake failed: the server's certificate is not signed by the CA this client trusts "
                "(tls_ca, --tls-ca, SHARDPS_TLS_CA)")
    if "WRONG_VERSION_NUMBER" in d or ("handshake" in d.lower() and not security.tls_cert and security.tls):
        return "TLS handshake failed: the server does not speak TLS (drop tls_ca) or refused this client"
    if "Tls handshake failed" in d or "SSL_ERROR" in d:
        return "TLS handshake failed"
    if "Socket closed" in d or "Connection reset" in d:
        if security.tls and not security.tls_cert:
            return ("the server closed the connection during the TLS handshake: it requires a client "
                    "certificate (mutual TLS) and this client has none (tls_cert/tls_key, --tls-cert/--tls-key, "
                    "SHARDPS_TLS_CERT/SHARDPS_TLS_KEY)")
        if not security.tls:
            return ("the server closed the connection: if it serves TLS, this client speaks plaintext "
                    "(give the CA: tls_ca, --tls-ca, SHARDPS_TLS_CA)")
        return "the server closed the connection during the TLS handshake: it does not accept this client's certificate"
    if "Connection refused" in d:
        return "nothing listens there (connection refused)"
    return ""


class StatusError(grpc.RpcError):
    """A failed call made other than by a gRPC channel (a data connection's frame, an expert actor's answer),
    read as gRPC's own errors are: ``code()``, ``details()``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    """A gRPC failure's status code and details (UNKNOWN and its text when it carries none)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else str(e)) or ""
    return code, details


def health_status(address: str, *, service: str = "", timeout: float = 5.0,
                  security: Security | None = None) -> tuple[str, bool]:
    """The gRPC health check of ``address``: (status name, whether SERVING); a failure raises ShardError."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (security if security is not None else Security.from_env()).channel(address)
    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                      timeout=timeout)
    except grpc.RpcError as e:
        code, details = status_of(e)
        raise shard_error(address, None, code, details) from None
    finally:
        channel.close()
    return (health_pb2.HealthCheckResponse.ServingStatus.Name(r.status),
            r.status == health_pb2.HealthCheckResponse.SERVING)


def run_health(address: str, *, timeout: float = 5.0, service: str = "shardps.v1.Workers",
               out: TextIO = sys.stdout, security: Security | None = None) -> int:
    """Exit status 0 only when the server at ``address`` answers SERVING (a container healthcheck)."""
    sec = security if security is not None else Security.from_env()
    try:
        status, serving = health_status(address, service=service, timeout=timeout, security=sec)
    except ShardError as e:
        out.write(f"{address}: {e.code.name}: {explain_unreachable(sec, e.details) or e.details}\n")
        return 1
    out.write(f"{address}: {status}\n")
    return 0 if serving else 1
