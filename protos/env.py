"""The ``SHARDPS_*`` environment variables, one rule for all of them.

Every setting is taken from, in this order: an explicit argument (a CLI flag
or a Python keyword), then its environment variable, then the default. The
CLI and the Python API (``connect``, ``DistributedOptimizer``, the servers)
follow the same rule; docs/operations.md lists every variable and
tests/test_docs.py checks that the list and this module agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ADDRESSES = "SHARDPS_ADDRESSES"  # HOST:PORT,... of the shards, in shard order
WORKER_ID = "SHARDPS_WORKER_ID"
NUM_WORKERS = "SHARDPS_NUM_WORKERS"
BACKUPS = "SHARDPS_BACKUPS"  # each shard's backup (--replicas 2), in shard order
TLS_CERT = "SHARDPS_TLS_CERT"
TLS_KEY = "SHARDPS_TLS_KEY"
TLS_CA = "SHARDPS_TLS_CA"
TLS_SERVER_NAME = "SHARDPS_TLS_SERVER_NAME"
AUTH_TOKEN = "SHARDPS_AUTH_TOKEN"
AUTH_TOKEN_FILE = "SHARDPS_AUTH_TOKEN_FILE"
# a token per audience (the shared one above works for all)
WORKER_TOKEN = "SHARDPS_WORKER_TOKEN"
WORKER_TOKEN_FILE = "SHARDPS_WORKER_TOKEN_FILE"
OPERATOR_TOKEN = "SHARDPS_OPERATOR_TOKEN"
OPERATOR_TOKEN_FILE = "SHARDPS_OPERATOR_TOKEN_FILE"
PEER_TOKEN = "SHARDPS_PEER_TOKEN"
PEER_TOKEN_FILE = "SHARDPS_PEER_TOKEN_FILE"
METRICS_PORT = "SHARDPS_METRICS_PORT"
METRICS_HOST = "SHARDPS_METRICS_HOST"
CHECKPOINT_DIR = "SHARDPS_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "SHARDPS_CHECKPOINT_EVERY"
LOG_LEVEL = "SHARDPS_LOG_LEVEL"
# `shardps server` (one container per server: compose, Kubernetes)
HOST = "SHARDPS_HOST"
PORT = "SHARDPS_PORT"
SHARD_INDEX = "SHARDPS_SHARD_INDEX"
NUM_SHARDS = "SHARDPS_NUM_SHARDS"
LEASE_SECONDS = "SHARDPS_LEASE_SECONDS"
REPLICAS = "SHARDPS_REPLICAS"
REPLICA_PORT = "SHARDPS_REPLICA_PORT"
REPLICA_TARGET = "SHARDPS_REPLICA_TARGET"
ADVERTISE_ADDRESS = "SHARDPS_ADVERTISE_ADDRESS"
COORDINATOR = "SHARDPS_COORDINATOR"  # `shardps server --coordinator etcd://...` (server/coordinator.py)
JOB = "SHARDPS_JOB"  # `shardps server --job`: the job's keys in the coordinator
SHM = "SHARDPS_SHM"  # 0: no same-host shared-memory fast path (workers)
FRAME_INLINE_BYTES = "SHARDPS_FRAME_INLINE_BYTES"  # `shardps server`: larger Pulls are framed outside the lock
KEEPALIVE_S = "SHARDPS_KEEPALIVE_S"  # seconds of silence before a channel pings its server (0: never)
FORK = "SHARDPS_FORK"  # 0: LocalCluster and the demo start each process fresh, not from the fork server

ALL = (ADDRESSES, WORKER_ID, NUM_WORKERS, BACKUPS, TLS_CERT, TLS_KEY, TLS_CA, TLS_SERVER_NAME, AUTH_TOKEN,
       AUTH_TOKEN_FILE, WORKER_TOKEN, WORKER_TOKEN_FILE, OPERATOR_TOKEN, OPERATOR_TOKEN_FILE, PEER_TOKEN,
       PEER_TOKEN_FILE, METRICS_PORT, METRICS_HOST, CHECKPOINT_DIR, CHECKPOINT_EVERY, LOG_LEVEL, HOST, PORT,
       SHARD_INDEX, NUM_SHARDS, LEASE_SECONDS, REPLICAS, REPLICA_PORT, REPLICA_TARGET, ADVERTISE_ADDRESS,
       SHM, FRAME_INLINE_BYTES, KEEPALIVE_S, FORK, COORDINATOR, JOB)


#: How OpenMP's idle threads wait (read once, when torch loads): a variable of these in the environment is the
#: user's choice and is left alone; where none is set, a shardps process starts with ``OPENMP_IDLE``.
OPENMP_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
OPENMP_IDLE = {"OMP_WAIT_POLICY": "PASSIVE"}


def openmp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to ``environ`` for a process that shardps starts (the ``shardps`` command, the fork server
    and its children): ``OPENMP_IDLE`` where ``environ`` sets none of ``OPENMP_KNOBS``, else nothing. An idle
    OpenMP thread otherwise spins for a while (libgomp: 300,000 turns) after each parallel region, taking a
    core from the process's own I/O threads and from the processes beside it (docs/operations.md, "OpenMP's
    idle threads"). A user's own process is never changed: set it there before torch is imported."""
    return {} if any(k in environ for k in OPENMP_KNOBS) else dict(OPENMP_IDLE)


def get(name: str) -> str | None:
    """The variable's value, or None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def get_int(name: str) -> int | None:
    """The variable as an integer (None when unset); ValueError naming it when it is not one."""
    value = get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def get_list(name: str) -> list[str] | None:
    """A comma-separated variable as a list (None when unset)."""
    value = get(name)
    return None if value is None else [a.strip() for a in value.split(",")]


def pick(arg: str | None, name: str, default: str | None = None) -> str | None:
    """``arg`` if given, else the variable, else ``default``."""
    if arg is not None:
        return arg
    value = get(name)
    return default if value is None else value


def get_float(name: str) -> float | None:
    """The variable as a number (None when unset); ValueError naming it when it is not one."""
    value = get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def pick_bool(arg: bool | None, name: str, default: bool) -> bool:
    """``arg`` if given, else the variable (1/true/yes/on or 0/false/no/off), else ``default``."""
    if arg is not None:
        return arg
    value = get(name)
    if value is None:
        return default
    v = value.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def pick_int(arg: int | None, name: str, default: int | None = None) -> int | None:
    if arg is not None:
        return arg
    value = get_int(name)
    return default if value is None else value
