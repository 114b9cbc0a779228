"""Running one shard as a process: ``shardps server``.

Prints ``shardps server listening on HOST:PORT`` on stdout once it serves
(what LocalCluster waits for), and stops on SIGTERM or SIGINT: health goes
NOT_SERVING, in-flight RPCs get a grace period, the process exits 0.

With ``--replicas 2`` the process also serves, on ``--replica-port``, the
backup of the previous shard (shard i-1 mod N: each server backs up its
neighbour); the ready line then ends with ``replica HOST:PORT``. Its own
shard forwards every change to ``--replica-target`` (the next server's
replica port), or to where ``shardps ctl attach-replica`` points it later.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import torch
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from shardps.protos import codec
from shardps.protos.exposition import LOOPBACK, serve_metrics
from shardps.protos.security import Security
from shardps.server.metrics import ServerMetrics
from shardps.server.service import DEFAULT_MAX_WAIT_S, SERVICE_NAME, create_server, stop_server
from shardps.server.store import DEFAULT_LEASE_S, ShardStore

log = logging.getLogger("shardps.server")

READY_PREFIX = "shardps server listening on "


def default_torch_threads() -> int:
    """Half the cores: the rest stay free for gRPC's threads (torch's idle threads spin)."""
    return max(1, (os.cpu_count() or 2) // 2)


def check_replicas(replicas: int, num_shards: int, replica_target: str | None) -> None:
    """ValueError for a replication setting that cannot work."""
    if replicas not in (1, 2):
        raise ValueError(f"--replicas must be 1 or 2, got {replicas}")
    if replicas == 2 and num_shards < 2:
        raise ValueError("--replicas 2 needs at least 2 servers (--num-shards): the backup lives on another one")
    if replica_target and replicas != 2:
        raise ValueError("--replica-target needs --replicas 2")


def advertised(host: str, port: int) -> str:
    """How other servers reach this one: HOST:PORT, the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def check_spare(backup_of: int, num_shards: int) -> None:
    if not 0 <= backup_of < num_shards or num_shards < 2:
        raise ValueError(f"--backup-only needs a shard in [0, --num-shards) and --num-shards >= 2, "
                         f"got shard {backup_of} of {num_shards}")


def run_spare(*, host: str = "127.0.0.1", replica_port: int = 0, backup_of: int = 0, num_shards: int = 2,
              chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, max_wait_s: float = DEFAULT_MAX_WAIT_S,
              grace_s: float = 5.0, torch_threads: int | None = None, security: Security | None = None,
              lease_s: float = DEFAULT_LEASE_S, metrics_host: str = "127.0.0.1", metrics_port: int | None = None,
              checkpoint_dir: str | None = None, checkpoint_every: int = 0) -> int:
    """``shardps server --backup-only K``: only a backup endpoint for shard K (no primary).

    A spare to give a shard a copy again after a takeover: point the shard
    at it with ``shardps ctl attach-replica``. It serves the shard if it is
    promoted in turn.
    """
    check_spare(backup_of, num_shards)
    torch.set_num_threads(torch_threads or default_torch_threads())
    security = security or Security()
    backup = ShardStore(backup_of, num_shards, lease_s=lease_s, role="backup")
    if checkpoint_dir:
        backup.enable_checkpoints(checkpoint_dir, every_steps=checkpoint_every)
    metrics = endpoint = None
    if metrics_port is not None:
        registry = CollectorRegistry()
        metrics = ServerMetrics(backup, registry)
        endpoint = serve_metrics(registry, metrics_host, metrics_port)
    server, bound = create_server(backup, f"{host}:{replica_port}", max_wait_s=max_wait_s, chunk_bytes=chunk_bytes,
                                  metrics=metrics, security=security)
    backup.address = advertised(host, bound)
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not stopping.is_set():
            stopping.set()
            server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)  # type: ignore[attr-defined]
            backup.close()
            server.stop(grace_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    extra = f" metrics {endpoint.address}" if endpoint is not None else ""
    print(f"{READY_PREFIX}{host}:{bound} (backup of shard {backup_of} of {num_shards}){extra} replica {host}:{bound}",
          flush=True)
    server.wait_for_termination()
    stop_server(server)
    if endpoint is not None:
        endpoint.close()
    return 0


def run_server(*, host: str = "127.0.0.1", port: int = 0, shard_index: int = 0, num_shards: int = 1,
               sync: str | None = None, num_workers: int | None = None,
               chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, max_wait_s: float = DEFAULT_MAX_WAIT_S,
               grace_s: float = 5.0, metrics_host: str = "127.0.0.1", metrics_port: int | None = None,
               torch_threads: int | None = None, security: Security | None = None,
               checkpoint_dir: str | None = None, checkpoint_every: int = 0,
               checkpoint_seconds: float = 0.0, lease_s: float = DEFAULT_LEASE_S, replicas: int = 1,
               replica_port: int = 0, replica_target: str | None = None, advertise: str | None = None) -> int:
    check_replicas(replicas, num_shards, replica_target)
    torch.set_num_threads(torch_threads or default_torch_threads())
    security = security or Security()
    if host not in LOOPBACK and not (security.tls and security.token):
        missing = " and ".join(w for w, ok in (("TLS", security.tls), ("a token", security.token)) if not ok)
        log.warning("shard %d binds %s, reachable from other machines, without %s: anyone who can reach it "
                    "can read and change the model", shard_index, host, missing)
    store = ShardStore(shard_index, num_shards, sync=sync, num_workers=num_workers, lease_s=lease_s)
    if checkpoint_dir:
        store.enable_checkpoints(checkpoint_dir, every_steps=checkpoint_every, every_seconds=checkpoint_seconds)
        restored = store.restore_latest()
        if restored is not None:
            store.recovering = True  # data RPCs answer ABORTED until the job rolls back consistently
            log.warning("shard %d: restored from checkpoint at version %d in %s", shard_index, restored,
                        checkpoint_dir)
    backup = None
    if replicas == 2:  # this process keeps the copy of the previous shard
        backup = ShardStore((shard_index - 1) % num_shards, num_shards, lease_s=lease_s, role="backup")
        if checkpoint_dir:  # used once it takes over
            backup.enable_checkpoints(checkpoint_dir, every_steps=checkpoint_every, every_seconds=checkpoint_seconds)
    metrics = endpoint = None
    if metrics_port is not None:
        registry = CollectorRegistry()
        metrics = ServerMetrics(store, registry, backups=[backup] if backup else [])
        endpoint = serve_metrics(registry, metrics_host, metrics_port)
    server, bound = create_server(store, f"{host}:{port}", max_wait_s=max_wait_s, chunk_bytes=chunk_bytes,
                                  metrics=metrics, security=security)
    servers = [server]
    store.address = advertise or advertised(host, bound)  # what its backup checks before taking over
    extra = f" metrics {endpoint.address}" if endpoint is not None else ""
    if backup is not None:
        backup_server, backup_port = create_server(backup, f"{host}:{replica_port}", max_wait_s=max_wait_s,
                                                   chunk_bytes=chunk_bytes, security=security)
        servers.append(backup_server)
        extra += f" replica {host}:{backup_port}"
        if replica_target:  # the sender retries until the backup answers; the first try settles first
            store.start_replicated(replica_target, timeout=10.0)
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        log.info("shard %d: signal %d, shutting down", shard_index, signum)
        for srv in servers:
            for svc in ("", SERVICE_NAME):
                srv.health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)  # type: ignore[attr-defined]
        for st in (store, backup):
            if st is not None:
                st.close()  # waits in progress end with UNAVAILABLE; new requests are refused
        for srv in servers:
            srv.stop(grace_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"{READY_PREFIX}{host}:{bound} (shard {shard_index} of {num_shards}){extra}", flush=True)
    for srv in servers:
        srv.wait_for_termination()
    for srv in servers:
        stop_server(srv)  # stopped already: joins its handler threads
    if checkpoint_dir and stopping.is_set():
        for st in (store, backup):
            if st is not None and st.role == "primary":
                path = st.checkpoint_now()
                log.warning("shard %d: checkpoint on shutdown at version %d: %s", st.shard_index, st.version, path)
    if endpoint is not None:
        endpoint.close()
    store.stop_replication()
    store.peers.close()
    log.info("shard %d: stopped at version %d", shard_index, store.version)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_server())
