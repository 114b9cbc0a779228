"""Parameter servers as Ray actors, placed by a placement group.

Each actor runs the same gRPC server as ``shardps server`` (``ShardServer``)
in its own process, bound to its node's IP, and reports the address it
serves on. ``start_servers`` returns a ``ServerGroup``: ``addresses`` (in
shard order, what workers connect to), the nodes they landed on, and
``shutdown()`` (also a context manager).

Two ways to survive a server's death:

- ``replicas=2``: every shard keeps a live backup in the next server's actor;
  workers fail over to it (no rollback). As outside Ray.
- ``max_restarts=N`` with a ``checkpoint_dir``: Ray starts the actor again in
  the same bundle (so on the same node); it restores its newest checkpoint
  and serves on the port it had (kept in the checkpoint directory), and the
  job rolls back to the newest checkpoint every shard holds, as it does after
  a restart outside Ray.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from shardps.deploy.local import attach_replicas
from shardps.deploy.ray.placement import (
    DEFAULT_PLACEMENT_TIMEOUT_S,
    actor_logging,
    check_strategy,
    in_bundle,
    place,
)
from shardps.protos.security import Security

log = logging.getLogger("shardps.ray")

# ShardServer options a caller may set; host, ports and the shard come from the group.
SERVER_OPTIONS = ("sync", "num_workers", "chunk_bytes", "max_wait_s", "grace_s", "metrics_port", "metrics_host",
                  "torch_threads", "security", "checkpoint_dir", "checkpoint_every", "checkpoint_seconds",
                  "lease_s", "host", "coordinator", "job", "coordinator_ttl", "start_timeout_s")


def _port_file(checkpoint_dir: str, shard: int) -> Path:
    return Path(checkpoint_dir) / f"shard-{shard}" / "serving.json"


class ServerActor:
    """One shard in a Ray actor. Serving starts in the constructor, so a restarted actor serves again."""

    def __init__(self, shard_index: int, num_shards: int, replicas: int, options: dict[str, Any]) -> None:
        from shardps.server.app import ShardServer

        actor_logging()
        opts = dict(options)
        host = opts.pop("host", None) or ray.util.get_node_ip_address()
        if opts.get("metrics_port") is not None and not opts.get("metrics_host"):
            opts["metrics_host"] = host  # scraped from other nodes: not loopback
        port = 0
        ckpt = opts.get("checkpoint_dir")
        with warnings.catch_warnings():  # Ray 2.60 warns about an API it uses inside this property
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted and ckpt and _port_file(ckpt, shard_index).exists():
            port = json.loads(_port_file(ckpt, shard_index).read_text())["port"]  # where the workers look
        self.server = ShardServer(host=host, port=port, shard_index=shard_index, num_shards=num_shards,
                                  replicas=replicas, **opts).start()
        if ckpt:
            path = _port_file(ckpt, shard_index)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"port": int(self.server.address.rsplit(":", 1)[1])}))
        self.restarted = restarted
        log.info("shard %d serving on %s%s", shard_index, self.server.address,
                    " (restarted by Ray)" if restarted else "")

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        s = self.server
        return {"shard": s.shard_index, "address": s.address, "replica_address": s.replica_address,
                "metrics_address": s.metrics_address, "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "restarted": self.restarted,
                "restored": s.restored}

    def stop(self) -> None:
        self.server.stop()


class ServerGroup:
    """Servers started by ``start_servers``: their addresses, nodes, and ``shutdown()``."""

    def __init__(self, actors: list[Any], placement: PlacementGroup, infos: list[dict[str, Any]],
                 security: Security | None) -> None:
        self.actors = actors
        self.placement_group = placement
        self.infos = infos
        self.security = security
        self._closed = False

    @property
    def addresses(self) -> list[str]:
        """Each shard's gRPC address, in shard order: pass them to ``shardps.connect``."""
        return [i["address"] for i in self.infos]

    @property
    def replica_addresses(self) -> list[str]:
        """replicas=2: where server i holds the backup of shard i-1."""
        return [i["replica_address"] for i in self.infos if i["replica_address"]]

    @property
    def backup_addresses(self) -> list[str]:
        """replicas=2: each shard's backup, in shard order (``connect(..., backups=)``); else empty."""
        reps, n = self.replica_addresses, len(self.infos)
        return [reps[(i + 1) % n] for i in range(n)] if reps else []

    @property
    def metrics_addresses(self) -> list[str]:
        return [i["metrics_address"] for i in self.infos if i["metrics_address"]]

    @property
    def node_ids(self) -> list[str]:
        """The Ray node each server runs on, in shard order."""
        return [i["node_id"] for i in self.infos]

    @property
    def pids(self) -> list[int]:
        return [i["pid"] for i in self.infos]

    def refresh(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Ask the actors again (after a restart: pids change, addresses do not)."""
        self.infos = ray.get([a.info.remote() for a in self.actors], timeout=timeout)
        return self.infos

    def prometheus_targets(self) -> list[dict[str, Any]]:
        """Prometheus file_sd entries for the servers' /metrics (servers started with metrics_port)."""
        return [{"targets": [i["metrics_address"]], "labels": {"job": "shardps-server", "shard": str(i["shard"]),
                                                                 "ray_node_id": i["node_id"]}}
                for i in self.infos if i["metrics_address"]]

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop every server (they checkpoint, with a checkpoint directory), end the actors, free the bundles."""
        if self._closed:
            return
        self._closed = True
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a dead actor has nothing to stop; the rest is released anyway
            log.warning("stopping the servers: %s", e)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.placement_group)

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def start_servers(num_servers: int, *, replicas: int = 1, strategy: str = "SPREAD",
                  resources: dict[str, float] | None = None, num_cpus: float = 1.0,
                  max_restarts: int = 0, placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT_S,
                  start_timeout: float = 120.0, **server_options: Any) -> ServerGroup:
    """Start ``num_servers`` parameter servers as Ray actors; returns once all serve (and, with
    ``replicas=2``, every backup is in sync).

    ``strategy``: how the placement group spreads them (SPREAD, PACK,
    STRICT_SPREAD, STRICT_PACK). ``resources``: extra resources each server
    asks for, e.g. ``{"ps": 0.001}`` to keep them on nodes started with
    ``--resources '{"ps": 1}'``. ``num_cpus`` per server (also its torch
    threads unless ``torch_threads`` says otherwise). ``server_options``: what
    ``shardps server`` takes: ``checkpoint_dir``, ``checkpoint_every``,
    ``checkpoint_seconds``, ``lease_s``, ``security``, ``metrics_port`` (0: a
    free port each), ``metrics_host``, ``sync``, ``num_workers``,
    ``chunk_bytes``, ``max_wait_s``, ``host`` (default: the node's IP);
    ``coordinator`` (``etcd://HOST:PORT``: deploy/ray/etcd.py), ``job``,
    ``coordinator_ttl``, ``start_timeout_s``.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if replicas not in (1, 2) or (replicas == 2 and num_servers < 2):
        raise ValueError(f"replicas must be 1, or 2 with at least 2 servers; got replicas={replicas} "
                         f"with {num_servers} servers")
    unknown = sorted(set(server_options) - set(SERVER_OPTIONS))
    if unknown:
        raise TypeError(f"start_servers: unknown server options {unknown}; known: {sorted(SERVER_OPTIONS)}")
    if max_restarts and not server_options.get("checkpoint_dir"):
        raise ValueError("max_restarts needs a checkpoint_dir: a restarted server restores its shard from it")
    if max_restarts and replicas == 2:
        raise ValueError("choose one way to survive a server's death: replicas=2 (fail over) or max_restarts "
                         "with a checkpoint_dir (restart and roll back)")
    strategy = check_strategy(strategy)
    server_options.setdefault("torch_threads", max(1, int(num_cpus)))
    bundle = {"CPU": float(num_cpus), **(resources or {})}
    t0 = time.monotonic()
    pg = place([dict(bundle) for _ in range(num_servers)], strategy, timeout=placement_timeout,
               what=f"shardps servers ({num_servers})")
    actors: list[Any] = []
    try:
        cls: Any = ray.remote(ServerActor)
        for i in range(num_servers):
            actors.append(cls.options(num_cpus=num_cpus, resources=resources or {}, max_restarts=max_restarts,
                                      max_task_retries=-1 if max_restarts else 0, name=None,
                                      **in_bundle(pg, i)).remote(i, num_servers, replicas, server_options))
        infos = ray.get([a.info.remote() for a in actors], timeout=start_timeout)
        group = ServerGroup(actors, pg, infos, server_options.get("security"))
        if replicas == 2:
            security = server_options.get("security") or Security.from_env()
            attach_replicas(group.addresses, group.replica_addresses, security, start_timeout)
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
        raise
    log.info("%d shardps servers up in %.1fs: %s", num_servers, time.monotonic() - t0, group.addresses)
    return group
