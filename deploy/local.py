"""LocalCluster: N parameter servers on free loopback ports, the embedded default.

``LocalCluster(num_servers=2)`` runs the servers in this process (one gRPC
server each, real sockets); ``processes=True`` starts each as its own
``shardps server`` process. Either way ``addresses`` lists them in shard
order, and leaving the ``with`` block stops everything it started.

``replicas=2`` gives every shard a backup on the next server (server i+1
mod N holds shard i's; ``replica_addresses[j]`` is the backup server j
holds). ``start`` returns once every backup is in sync.
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import threading
import time
from collections.abc import Sequence
from types import TracebackType

import grpc
from prometheus_client import CollectorRegistry

from shardps.deploy.lifeline import Lifeline
from shardps.deploy.spawn import Process, spawn
from shardps.exposition import MetricsEndpoint, serve_metrics
from shardps.protos import codec
from shardps.protos import env as env_names
from shardps.protos.security import Security
from shardps.server import coordinator as coord
from shardps.server.app import READY_PREFIX
from shardps.server.checks import check_coordinator, check_replicas
from shardps.server.metrics import ServerMetrics
from shardps.server.service import create_server, served, stop_server
from shardps.server.store import DEFAULT_LEASE_S, ShardStore
from shardps.worker.operator import attach_replica


def read_ready(proc: Process, timeout: float, prefix: str = READY_PREFIX) -> str:
    """Wait (up to ``timeout``) for the process's line starting with ``prefix``; return the rest of it."""
    return read_ready_lines(proc, timeout, 1, prefix)[0]


def read_ready_lines(proc: Process, timeout: float, count: int,
                     prefix: str = READY_PREFIX) -> list[str]:
    """``read_ready`` for a process that prints ``count`` such lines (``shardps server --shards``)."""
    lines: queue.Queue[str | None] = queue.Queue()
    found: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"server (pid {proc.pid}) did not report ready within {timeout:.0f}s; "
                               f"output: {''.join(seen)[-500:]!r}")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"server (pid {proc.pid}) exited with {proc.wait(timeout=5)} before it was ready; "
                               f"output: {''.join(seen)[-2000:]}")
        seen.append(line)
        if line.startswith(prefix):
            found.append(line[len(prefix):].strip())
            if len(found) == count:
                return found


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (pidfd, not polling) until every pid has exited; the pids still alive at the deadline.

    For processes that are not this one's children (their parent is gone, or another process started them).
    """
    deadline = time.monotonic() + timeout
    alive = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            continue
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                alive.append(pid)
        finally:
            os.close(fd)
    return alive


def stop_processes(procs: Sequence[Process], grace: float = 5.0) -> None:
    """SIGTERM every process, wait up to ``grace`` seconds each, then SIGKILL; close their stdout."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=grace)
        if p.stdout is not None and not p.stdout.closed:
            p.stdout.close()


def parse_ready(rest: str) -> tuple[str, str | None]:
    """(gRPC address, metrics address or None) from a ready line's text after the prefix."""
    return rest.split()[0], ready_field(rest, "metrics")


def ready_field(rest: str, key: str) -> str | None:
    """The value after ``key`` in a ready line ("metrics", "replica"), or None."""
    words = rest.split()
    return words[words.index(key) + 1] if key in words[:-1] else None


#: The variables of a `shardps server` that a LocalCluster decides itself, from its arguments, in process
#: mode as in process: its server processes do not get them from its environment, where they would take effect
#: for every setting it passes no flag for (a ``SHARDPS_COORDINATOR`` exported for a real job would have a
#: local cluster's servers claim that job's shards in etcd, a ``SHARDPS_CHECKPOINT_DIR`` write checkpoints
#: into its directory, a ``SHARDPS_METRICS_PORT`` have every server bind one port). Security is not among them:
#: the cluster takes it from the same variables (``Security.from_env``) and passes it on.
CLUSTER_DECIDES = frozenset((
    env_names.HOST, env_names.PORT, env_names.SHARD_INDEX, env_names.NUM_SHARDS, env_names.LEASE_SECONDS,
    env_names.REPLICAS, env_names.REPLICA_PORT, env_names.REPLICA_TARGET, env_names.ADVERTISE_ADDRESS,
    env_names.COORDINATOR, env_names.JOB, env_names.CHECKPOINT_DIR, env_names.CHECKPOINT_EVERY,
    env_names.METRICS_PORT, env_names.METRICS_HOST,
))


def attach_replicas(addresses: Sequence[str], replica_addresses: Sequence[str], security: Security,
                    timeout: float) -> None:
    """Point shard i's primary at the backup server i+1 holds; wait until every backup is in sync."""
    n = len(addresses)
    for i, address in enumerate(addresses):
        target = replica_addresses[(i + 1) % n]
        state = attach_replica(address, target, timeout=timeout, security=security, wait_for_ready=True).replica_state
        if state != "synced":
            raise RuntimeError(f"shard {i} ({address}): its backup at {target} is {state!r} after {timeout:.0f}s")


class LocalCluster:
    """Parameter servers on loopback for one machine: tests, the demo, notebooks."""

    def __init__(self, num_servers: int = 2, *, processes: bool = False, host: str = "127.0.0.1",
                 chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, startup_timeout: float = 60.0,
                 max_wait_s: float = 300.0, metrics: bool = False, security: Security | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 interceptors: Sequence[grpc.ServerInterceptor] = (), lease_s: float = DEFAULT_LEASE_S,
                 replicas: int = 1, coordinator: str | None = None, job: str = coord.DEFAULT_JOB,
                 coordinator_ttl: int = coord.DEFAULT_TTL_S) -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        check_replicas(replicas, num_servers, None)
        # who serves each shard is etcd's to say (server/coordinator.py): ValueError naming what is wrong
        self.coordinator = check_coordinator(coordinator, job, coordinator_ttl) if coordinator else None
        self.coordinator_url, self.job, self.coordinator_ttl = coordinator, job, coordinator_ttl
        self.fences: list[coord.ShardLease] = []  # in-process mode with a coordinator: each store's hold
        self._etcd: coord.Etcd | None = None
        self.replicas = replicas
        self.num_servers = num_servers
        self.processes = processes
        self.host = host
        self.chunk_bytes = chunk_bytes
        self.startup_timeout = startup_timeout
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self.security = security if security is not None else Security.from_env()
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.interceptors = list(interceptors)  # in-process mode: e.g. fault injection in tests
        self.lease_s = lease_s
        self.addresses: list[str] = []
        self.metrics_addresses: list[str] = []  # HOST:PORT of each shard's /metrics, with metrics=True
        self.registries: list[CollectorRegistry] = []  # in-process mode with metrics=True
        self._endpoints: list[MetricsEndpoint] = []
        self.stores: list[ShardStore] = []  # in-process mode only
        self.backups: list[ShardStore] = []  # in-process mode with replicas=2: the backup server i holds
        self.replica_addresses: list[str] = []  # replicas=2: where server i holds the backup of shard i-1
        self._servers: list[grpc.Server] = []
        self._procs: list[Process] = []
        self._lifeline: Lifeline | None = None  # processes=True: the servers die with this process

    def start(self) -> LocalCluster:
        try:
            if self.processes:
                self._start_processes()
            else:
                for i in range(self.num_servers):
                    store = ShardStore(i, self.num_servers, lease_s=self.lease_s)
                    if self.checkpoint_dir:
                        store.checkpointer.enable(self.checkpoint_dir, every_steps=self.checkpoint_every)
                        if store.restore_latest() is not None:
                            store.job.recovering = True
                    backups = []
                    if self.replicas == 2:
                        backup = ShardStore((i - 1) % self.num_servers, self.num_servers, lease_s=self.lease_s,
                                            role="backup")
                        server, port = create_server(backup, f"{self.host}:0", chunk_bytes=self.chunk_bytes,
                                                     max_wait_s=self.max_wait_s, security=self.security,
                                                     interceptors=self.interceptors)
                        self._servers.append(server)
                        self.backups.append(backup)
                        self.replica_addresses.append(f"{self.host}:{port}")
                        backups.append(backup)
                    metrics = None
                    if self.metrics:
                        registry = CollectorRegistry()
                        metrics = ServerMetrics(store, registry, backups=backups)
                        endpoint = serve_metrics(registry, self.host, 0)
                        self.registries.append(registry)
                        self._endpoints.append(endpoint)
                        self.metrics_addresses.append(endpoint.address)
                    server, port = create_server(store, f"{self.host}:0", chunk_bytes=self.chunk_bytes,
                                                 max_wait_s=self.max_wait_s, metrics=metrics, security=self.security,
                                                 interceptors=self.interceptors)
                    self.stores.append(store)
                    self._servers.append(server)
                    self.addresses.append(f"{self.host}:{port}")
                self._fence()
            if self.replicas == 2:
                attach_replicas(self.addresses, self.replica_addresses, self.security, self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _fence(self) -> None:
        """In-process, with a coordinator: each primary claims its shard in etcd, each backup gets its way to
        take over (as ``shardps server --coordinator`` does)."""
        if self.coordinator is None:
            return
        self._etcd = etcd = coord.Etcd(self.coordinator)
        etcd.check(self.startup_timeout)
        for store, address in zip(self.stores, self.addresses, strict=True):
            fence = coord.ShardLease(etcd, self.job, store.shard_index, address, ttl=self.coordinator_ttl)
            store.replica.fence = fence
            self.fences.append(fence)
            fence.claim(timeout=self.startup_timeout)
        for backup, address in zip(self.backups, self.replica_addresses, strict=True):
            held = coord.ShardLease(etcd, self.job, backup.shard_index, address, ttl=self.coordinator_ttl)
            backup.replica.fence = held
            self.fences.append(held)

    def _start_processes(self) -> None:
        for i in range(self.num_servers):
            cmd = ["server", "--host", self.host, "--port", "0",  # `shardps` arguments: spawn() adds the command
                   "--shard-index", str(i), "--num-shards", str(self.num_servers),
                   "--chunk-bytes", str(self.chunk_bytes), "--max-wait", str(self.max_wait_s)]
            if self.metrics:
                cmd += ["--metrics-host", self.host, "--metrics-port", "0"]
            cmd += ["--lease-seconds", str(self.lease_s)]
            if self.replicas == 2:
                cmd += ["--replicas", "2", "--replica-port", "0"]
            if self.coordinator_url:
                cmd += ["--coordinator", self.coordinator_url, "--job", self.job,
                        "--coordinator-ttl", str(self.coordinator_ttl)]
            sec = self.security
            for flag, value in (("--tls-cert", sec.tls_cert), ("--tls-key", sec.tls_key), ("--tls-ca", sec.tls_ca)):
                if value:
                    cmd += [flag, value]
            if self.checkpoint_dir:
                cmd += ["--checkpoint-dir", self.checkpoint_dir, "--checkpoint-every", str(self.checkpoint_every)]
            # (deploy/spawn.py: forked from the fork server) Only this cluster's settings: none of the variables
            # that configure a server where no flag is given (CLUSTER_DECIDES).
            env = {k: v for k, v in os.environ.items() if k not in CLUSTER_DECIDES}
            env["PYTHONUNBUFFERED"] = "1"
            for var, value in ((env_names.AUTH_TOKEN, sec.token), (env_names.WORKER_TOKEN, sec.worker_token),
                               (env_names.OPERATOR_TOKEN, sec.operator_token), (env_names.PEER_TOKEN, sec.peer_token)):
                if value:
                    env[var] = value
            if self._lifeline is None:
                self._lifeline = Lifeline()
            self._procs.append(spawn(cmd, env=env, lifeline_fd=self._lifeline.read_fd))
        for proc in self._procs:
            rest = read_ready(proc, self.startup_timeout)
            address, metrics = parse_ready(rest)
            self.addresses.append(address)
            replica = ready_field(rest, "replica")
            if replica is not None:
                self.replica_addresses.append(replica)
            if metrics is not None:
                self.metrics_addresses.append(metrics)

    @property
    def backup_addresses(self) -> list[str]:
        """Each shard's backup, in shard order (replicas=2; else empty): ``connect(..., backups=)``."""
        n = self.num_servers
        return [self.replica_addresses[(i + 1) % n] for i in range(n)] if self.replica_addresses else []

    @property
    def pids(self) -> list[int]:
        """The server processes' ids (processes=True; else empty): for their CPU time (benchmarks/rows.py)."""
        return [p.pid for p in self._procs]

    def serving_addresses(self) -> list[str]:
        """Where each shard is served now: its primary, or (replicas=2) its backup if the primary was killed."""
        out = list(self.addresses)
        for i, proc in enumerate(self._procs):
            if proc.poll() is not None and self.replica_addresses:
                out[i] = self.backup_addresses[i]
        return out

    def stop_server(self, index: int) -> None:
        """Stop server ``index`` (in-process; the order of ``start``: with replicas=2 each shard's backup
        endpoint comes before its primary) as a process that stops would: its gRPC port and its shard's
        route on the process's data port, its calls ended at once. For failover drills and tests."""
        if self.processes:
            raise RuntimeError("stop_server() is for in-process servers: kill() a process")
        server = self._servers[index]
        server.stop(None)  # its handlers still waiting end with the stores (``stop``), as before
        data = served(server).data
        if data is not None:  # its frames are answered UNAVAILABLE from now on
            data[0].detach(data[1])

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` (processes=True): a crash, for failover drills and tests."""
        if not self.processes:
            raise RuntimeError("kill() needs processes=True")
        proc = self._procs[index]
        proc.kill()
        proc.wait(timeout=30)

    def stop(self, grace: float = 5.0) -> None:
        """Stop everything started: servers (waiting until each has ended), metrics, processes."""
        for st in self.stores + self.backups:
            st.close()  # parked waits end (UNAVAILABLE), so the handler threads can be joined
        for s in self._servers:
            stop_server(s, grace=None)
        for st in self.stores + self.backups:
            st.leases.stop_reaper()
            st.replica.stop_replication()
            if st.applier.peers is not None:
                st.applier.peers.close()
        for e in self._endpoints:
            e.close()
        self._endpoints = []
        for fence in self.fences:
            fence.close()
        self.fences = []
        if self._etcd is not None:
            self._etcd.close()
            self._etcd = None
        stop_processes(self._procs, grace)
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        self._servers, self._procs = [], []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
