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

import gc
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from shardps.exposition import LOOPBACK, MetricsEndpoint, serve_metrics
from shardps.protos import codec
from shardps.protos.security import Security
from shardps.server import coordinator as coord
from shardps.server.checks import check_replicas, check_spare
from shardps.server.datapath.reader import FRAME_INLINE_BYTES
from shardps.server.metrics import ServerMetrics
from shardps.server.replication.roles import Role
from shardps.server.replication.state import DEFAULT_REPLICA_TIMEOUT_S
from shardps.server.service import DEFAULT_MAX_WAIT_S, SERVICES, create_server, served, stop_server
from shardps.server.store import DEFAULT_LEASE_S, ShardStore

log = logging.getLogger("shardps.server")

READY_PREFIX = "shardps server listening on "


def default_torch_threads() -> int:
    """Half the cores: the rest stay free for gRPC's threads (torch's idle threads spin)."""
    return max(1, (os.cpu_count() or 2) // 2)


def advertised(host: str, port: int) -> str:
    """How other servers reach this one: HOST:PORT, the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def advertised_beside(advertise: str | None, host: str, port: int) -> str:
    """How other servers reach this process's second port (the backup it holds): the host of ``advertise``
    (``--advertise-address``, HOST:PORT) when given, as the main port's, else ``advertised``."""
    if advertise:
        return f"{advertise.rsplit(':', 1)[0]}:{port}"
    return advertised(host, port)


def check_replica_timeout(seconds: float) -> float:
    """``seconds`` if it is a replica timeout (a number > 0), else ValueError."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"the replica timeout must be a number of seconds > 0, got {seconds!r}")
    return float(seconds)


def check_frame_inline_bytes(n: int) -> int:
    """``frame_inline_bytes`` if it is one (an int >= 0; see server/datapath/reader.py), else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"frame_inline_bytes must be an integer >= 0, got {n!r}")
    return n


def run_spare(*, host: str = "127.0.0.1", replica_port: int = 0, backup_of: int = 0, num_shards: int = 2,
              chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, max_wait_s: float = DEFAULT_MAX_WAIT_S,
              grace_s: float = 5.0, torch_threads: int | None = None, security: Security | None = None,
              lease_s: float = DEFAULT_LEASE_S, metrics_host: str = "127.0.0.1", metrics_port: int | None = None,
              checkpoint_dir: str | None = None, checkpoint_every: int = 0,
              frame_inline_bytes: int = FRAME_INLINE_BYTES,
              replica_timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S, coordinator: str | None = None,
              job: str = coord.DEFAULT_JOB, coordinator_ttl: int = coord.DEFAULT_TTL_S,
              start_timeout_s: float = 30.0) -> int:
    """``shardps server --backup-only K``: only a backup endpoint for shard K (no primary).

    A spare to give a shard a copy again after a takeover: point the shard
    at it with ``shardps ctl attach-replica``. It serves the shard if it is
    promoted in turn (with a coordinator, only once etcd agrees).
    """
    check_spare(backup_of, num_shards)
    torch.set_num_threads(torch_threads or default_torch_threads())
    security = security or Security()
    backup = ShardStore(backup_of, num_shards, lease_s=lease_s, role=Role.BACKUP)
    backup.reader.frame_inline_bytes = check_frame_inline_bytes(frame_inline_bytes)
    backup.replica.replica_timeout_s = check_replica_timeout(replica_timeout_s)  # its own backup's, once promoted
    if checkpoint_dir:
        backup.checkpointer.enable(checkpoint_dir, every_steps=checkpoint_every)
    metrics = endpoint = None
    if metrics_port is not None:
        registry = CollectorRegistry()
        metrics = ServerMetrics(backup, registry)
        endpoint = serve_metrics(registry, metrics_host, metrics_port)
    server, bound = create_server(backup, f"{host}:{replica_port}", max_wait_s=max_wait_s, chunk_bytes=chunk_bytes,
                                  metrics=metrics, security=security)
    backup.replica.address = advertised(host, bound)
    etcd = None
    if coordinator:
        etcd = coord.Etcd(coord.parse(coordinator))
        try:
            etcd.check(start_timeout_s)
        except coord.CoordinatorError as e:
            stop_server(server)
            print(f"shardps server: {e}", file=sys.stderr, flush=True)
            return 2
        backup.replica.fence = coord.ShardLease(etcd, job, backup_of, backup.replica.address, ttl=coordinator_ttl)
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not stopping.is_set():
            stopping.set()
            served(server).not_serving(SERVICES)
            backup.close()
            server.stop(grace_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    extra = f" metrics {endpoint.address}" if endpoint is not None else ""
    print(f"{READY_PREFIX}{host}:{bound} (backup of shard {backup_of} of {num_shards}){extra} replica {host}:{bound}",
          flush=True)
    server.wait_for_termination()
    stop_server(server)
    if backup.replica.fence is not None and isinstance(backup.replica.fence, coord.ShardLease):
        backup.replica.fence.close(release=stopping.is_set())
    if etcd is not None:
        etcd.close()
    if endpoint is not None:
        endpoint.close()
    return 0


class ShardServer:
    """One shard served over gRPC, exactly as ``shardps server`` runs it; also what a Ray actor runs.

    ``start()`` binds and serves (``address``, ``replica_address`` and
    ``metrics_address`` are known then); ``begin_stop()`` is safe in a
    signal handler (health NOT_SERVING, waits end with UNAVAILABLE, RPCs
    get ``grace_s``); ``wait()`` blocks until the servers have ended, then
    checkpoints (with a checkpoint directory, when stopped on purpose) and
    releases everything. ``stop()`` is both.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, shard_index: int = 0, num_shards: int = 1,
                 sync: str | None = None, num_workers: int | None = None,
                 chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 grace_s: float = 5.0, metrics_host: str = "127.0.0.1", metrics_port: int | None = None,
                 torch_threads: int | None = None, security: Security | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 checkpoint_seconds: float = 0.0, lease_s: float = DEFAULT_LEASE_S, replicas: int = 1,
                 replica_port: int = 0, replica_target: str | None = None, advertise: str | None = None,
                 frame_inline_bytes: int = FRAME_INLINE_BYTES,
                 replica_timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S, coordinator: str | None = None,
                 job: str = coord.DEFAULT_JOB, coordinator_ttl: int = coord.DEFAULT_TTL_S,
                 start_timeout_s: float = 30.0) -> None:
        check_replicas(replicas, num_shards, replica_target)
        self.coordinator = coord.parse(coordinator) if coordinator else None  # ValueError naming what is wrong
        coord.check_job(job)
        self.job, self.coordinator_ttl, self.start_timeout_s = job, coordinator_ttl, start_timeout_s
        self._etcd: coord.Etcd | None = None
        self.fences: list[coord.ShardLease] = []
        self.replica_timeout_s = check_replica_timeout(replica_timeout_s)
        self.frame_inline_bytes = check_frame_inline_bytes(frame_inline_bytes)
        self.host, self.port, self.shard_index, self.num_shards = host, port, shard_index, num_shards
        self.sync, self.num_workers, self.chunk_bytes, self.max_wait_s = sync, num_workers, chunk_bytes, max_wait_s
        self.grace_s, self.metrics_host, self.metrics_port = grace_s, metrics_host, metrics_port
        self.torch_threads = torch_threads
        self.security = security if security is not None else Security.from_env()
        self.checkpoint_dir, self.checkpoint_every, self.checkpoint_seconds = (
            checkpoint_dir, checkpoint_every, checkpoint_seconds)
        self.lease_s, self.replicas, self.replica_port = lease_s, replicas, replica_port
        self.replica_target, self.advertise = replica_target, advertise
        self.store: ShardStore | None = None
        self.backup: ShardStore | None = None
        self.address = ""  # HOST:PORT it serves on
        self.replica_address = ""  # replicas=2: HOST:PORT of the backup it holds
        self.metrics_address = ""
        self.restored: int | None = None  # the checkpoint version restored on start
        self._servers: list[grpc.Server] = []
        self._endpoint: MetricsEndpoint | None = None
        self._stopping = threading.Event()

    def start(self) -> ShardServer:
        torch.set_num_threads(self.torch_threads or default_torch_threads())
        security, host, shard_index = self.security, self.host, self.shard_index
        if host not in LOOPBACK and not (security.tls and security.any_token):
            missing = " and ".join(w for w, ok in (("TLS", security.tls), ("a token", security.any_token)) if not ok)
            log.warning("shard %d binds %s, reachable from other machines, without %s: anyone who can reach it "
                        "can read and change the model", shard_index, host, missing)
        store = ShardStore(shard_index, self.num_shards, sync=self.sync, num_workers=self.num_workers,
                           lease_s=self.lease_s)
        store.reader.frame_inline_bytes = self.frame_inline_bytes
        store.replica.replica_timeout_s = self.replica_timeout_s
        self.store = store
        if self.checkpoint_dir:
            store.checkpointer.enable(self.checkpoint_dir, every_steps=self.checkpoint_every,
                                     every_seconds=self.checkpoint_seconds)
            self.restored = store.restore_latest()
            if self.restored is not None:
                store.job.recovering = True  # data RPCs answer ABORTED until the job rolls back consistently
                log.warning("shard %d: restored from checkpoint at version %d in %s", shard_index, self.restored,
                            self.checkpoint_dir)
        if self.replicas == 2:  # this process keeps the copy of the previous shard
            self.backup = ShardStore((shard_index - 1) % self.num_shards, self.num_shards, lease_s=self.lease_s,
                                     role=Role.BACKUP)
            self.backup.reader.frame_inline_bytes = self.frame_inline_bytes
            self.backup.replica.replica_timeout_s = self.replica_timeout_s  # once promoted, for a spare attached to it
            if self.checkpoint_dir:  # used once it takes over
                self.backup.checkpointer.enable(self.checkpoint_dir, every_steps=self.checkpoint_every,
                                               every_seconds=self.checkpoint_seconds)
        metrics = None
        if self.metrics_port is not None:
            registry = CollectorRegistry()
            metrics = ServerMetrics(store, registry, backups=[self.backup] if self.backup else [])
            self._endpoint = serve_metrics(registry, self.metrics_host, self.metrics_port)
            self.metrics_address = self._endpoint.address
        server, bound = create_server(store, f"{host}:{self.port}", max_wait_s=self.max_wait_s,
                                      chunk_bytes=self.chunk_bytes, metrics=metrics, security=security)
        self._servers.append(server)
        self.address = f"{host}:{bound}"
        store.replica.address = self.advertise or advertised(host, bound)  # what its backup checks before taking over
        backup_port = 0
        if self.backup is not None:
            backup_server, backup_port = create_server(self.backup, f"{host}:{self.replica_port}",
                                                       max_wait_s=self.max_wait_s, chunk_bytes=self.chunk_bytes,
                                                       security=security)
            self._servers.append(backup_server)
            self.replica_address = f"{host}:{backup_port}"
        try:
            deposed = self._fence(store, advertised_beside(self.advertise, host, backup_port)
                                  if self.backup is not None else "")
        except BaseException:
            self.stop()
            raise
        if self.backup is not None and self.replica_target and not deposed:
            # the sender retries until the backup answers; the first try settles first
            store.replica.start_replicated(self.replica_target, timeout=10.0)
        return self

    def _fence(self, store: ShardStore, backup_address: str) -> bool:
        """With a coordinator: claim this shard in etcd before anything is acknowledged (data RPCs answer
        UNAVAILABLE until then), and give the backup it holds its way to take over. True when etcd names
        another server the shard's primary: this one is deposed and serves nothing (a restart after a
        takeover). CoordinatorError, naming the coordinator, when etcd does not answer within the start
        timeout."""
        if self.coordinator is None:
            return False
        self._etcd = etcd = coord.Etcd(self.coordinator)
        etcd.check(self.start_timeout_s)
        fence = coord.ShardLease(etcd, self.job, self.shard_index, store.replica.address, ttl=self.coordinator_ttl)
        store.replica.fence = fence
        self.fences.append(fence)
        if self.backup is not None:
            held = coord.ShardLease(etcd, self.job, self.backup.shard_index, backup_address, ttl=self.coordinator_ttl)
            self.backup.replica.fence = held
            self.fences.append(held)
        try:
            record = fence.claim(timeout=self.start_timeout_s)
        except coord.Superseded as e:
            log.error("shard %d: %s; this server does not serve it", self.shard_index, e)
            store.replica._deposed(e.record.primary)
            return True
        log.info("shard %d: primary at epoch %d (etcd at %s, lease %ds)", self.shard_index, record.epoch,
                 etcd.where, self.coordinator_ttl)
        return False

    def ready_line(self) -> str:
        """What ``shardps server`` prints once it serves (LocalCluster reads it)."""
        extra = f" metrics {self.metrics_address}" if self.metrics_address else ""
        extra += f" replica {self.replica_address}" if self.replica_address else ""
        return f"{READY_PREFIX}{self.address} (shard {self.shard_index} of {self.num_shards}){extra}"

    def begin_stop(self) -> None:
        """Start shutting down (idempotent; safe in a signal handler)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for srv in self._servers:
            served(srv).not_serving()
        for st in (self.store, self.backup):
            if st is not None:
                st.close()  # waits in progress end with UNAVAILABLE; new requests are refused
        for srv in self._servers:
            srv.stop(self.grace_s)

    def wait(self) -> None:
        """Block until the servers end; then checkpoint (if stopped on purpose) and release everything."""
        for srv in self._servers:
            srv.wait_for_termination()
        for srv in self._servers:
            stop_server(srv)  # stopped already: joins its handler threads
        if self.checkpoint_dir and self._stopping.is_set():
            for st in (self.store, self.backup):
                if st is not None and st.replica.role is Role.PRIMARY:
                    path = st.checkpoint_now()
                    log.warning("shard %d: checkpoint on shutdown at version %d: %s", st.shard_index, st.job.version,
                                path)
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
        for st in (self.store, self.backup):
            if st is not None:
                st.leases.stop_reaper()
                st.replica.stop_replication()
                if st.applier.peers is not None:
                    st.applier.peers.close()
        for fence in self.fences:  # a clean stop gives the lease back: a backup may take over at once
            fence.close(release=self._stopping.is_set())
        if self._etcd is not None:
            self._etcd.close()
        if self.store is not None:
            log.info("shard %d: stopped at version %d", self.shard_index, self.store.job.version)

    def stop(self) -> None:
        self.begin_stop()
        self.wait()


# glibc's malloc: M_TRIM_THRESHOLD, M_MMAP_THRESHOLD and M_ARENA_MAX (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def keep_freed_memory(trim_bytes: int = 256 << 20, mmap_bytes: int = 64 << 20) -> bool:
    """Have glibc's malloc keep freed memory for reuse (a server process's own setting; True if set).

    A Pull frames its messages in fresh 1 MiB buffers and frees them once
    sent. By default glibc returns such memory to the kernel at once (large
    blocks are mapped and unmapped, the heap's free top is trimmed), so every
    Pull pays page faults and the kernel's zeroing of the pages before its
    own copy. Keeping up to ``trim_bytes`` free at the heap's top, and serving
    blocks below ``mmap_bytes`` from the heap, takes that away; and one arena
    for all threads (unless ``MALLOC_ARENA_MAX`` is set): the Pull handlers
    and framing threads are not the main thread, and glibc gives a non-main
    thread its own arena of 64 MB heaps, each unmapped as soon as it is all
    free, whatever the trim threshold, so a Pull of tens of MB framed there
    faulted its pages in again every time (measured in docs/performance.md).
    The Python threads take turns on the interpreter's lock anyway. No-op off
    glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or "musl" in name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not os.environ.get("MALLOC_ARENA_MAX") and not mallopt(_M_ARENA_MAX, 1):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))


def shard_options(options: dict[str, Any], k: int) -> dict[str, Any]:
    """The k-th shard's options of a process serving several (``--shards``): the next shard index, and
    the next port of each port given (0 stays 0: a free one)."""
    out = dict(options)
    out["shard_index"] = options.get("shard_index", 0) + k
    for key in ("port", "metrics_port"):
        if out.get(key):
            out[key] = out[key] + k
    return out


def run_server(*, shards: int = 1, **options: Any) -> int:
    """``shardps server``: serve one shard (``shards``: that many consecutive ones, each on its own port)
    until SIGTERM or SIGINT (options: those of ``ShardServer``)."""
    if not keep_freed_memory():
        log.info("malloc not tuned (not glibc): every Pull's buffers come from fresh pages")
    servers: list[ShardServer] = []

    def on_signal(signum: int, frame: object) -> None:
        log.info("shards %s: signal %d, shutting down", [s.shard_index for s in servers], signum)
        for server in servers:
            server.begin_stop()

    try:
        for k in range(shards):
            servers.append(ShardServer(**shard_options(options, k)).start())
    except coord.CoordinatorError as e:
        for server in servers:
            server.stop()
        print(f"shardps server: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException:
        for server in servers:
            server.stop()
        raise
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # What start-up made (torch's modules, the shards' tables: hundreds of thousands of objects) lives as long
    # as the process: out of the collector's way, so that a collection walks only what serving allocates.
    gc.freeze()
    for server in servers:
        print(server.ready_line(), flush=True)
    for server in servers:
        server.wait()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_server())
