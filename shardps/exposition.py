"""Serving a Prometheus registry over HTTP (``/metrics``), for servers and workers alike."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("shardps")

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP endpoint; ``close()`` stops it."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsEndpoint:
    """Expose ``registry`` at http://host:port/metrics (port 0: a free one)."""
    if host not in LOOPBACK:
        log.warning("metrics endpoint bound to %s:%d, reachable beyond this machine", host, port)
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsEndpoint(host, server.server_port, server, thread)
