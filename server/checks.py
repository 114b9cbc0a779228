"""``shardps server``'s settings checked before anything heavy is imported: a refused setting answers at once
(the command checks these before it imports the server, and torch with it)."""

from __future__ import annotations


def check_replicas(replicas: int, num_shards: int, replica_target: str | None) -> None:
    """ValueError for a replication setting that cannot work."""
    if replicas not in (1, 2):
        raise ValueError(f"--replicas must be 1 or 2, got {replicas}")
    if replicas == 2 and num_shards < 2:
        raise ValueError("--replicas 2 needs at least 2 servers (--num-shards): the backup lives on another one")
    if replica_target and replicas != 2:
        raise ValueError("--replica-target needs --replicas 2")


def check_spare(backup_of: int, num_shards: int) -> None:
    if not 0 <= backup_of < num_shards or num_shards < 2:
        raise ValueError(f"--backup-only needs a shard in [0, --num-shards) and --num-shards >= 2, "
                         f"got shard {backup_of} of {num_shards}")


def check_shards(count: int, shard_index: int, num_shards: int, replicas: int) -> None:
    """``--shards``: ``count`` consecutive shards from ``shard_index`` in one process."""
    if count < 1:
        raise ValueError(f"--shards must be >= 1, got {count}")
    if not 0 <= shard_index or shard_index + count > num_shards:
        raise ValueError(f"--shard-index {shard_index} with --shards {count}: shards {shard_index}.."
                         f"{shard_index + count - 1} of --num-shards {num_shards} do not exist")
    if count > 1 and replicas != 1:
        raise ValueError("--shards > 1 serves primaries only: give each process one shard with --replicas 2")


def parse_coordinator(spec: str) -> list[str]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` -> the endpoints (``HOST:PORT``); ValueError naming what is wrong."""
    if not spec.startswith("etcd://"):
        raise ValueError(f"coordinator {spec!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    out = []
    for part in spec[len("etcd://"):].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"coordinator {spec!r}: {part!r} is not HOST:PORT")
        out.append(f"{host}:{port}")
    return out


def check_job(job: str) -> str:
    """A job name as the coordinator's keys take it; ValueError naming it otherwise."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", job):
        raise ValueError(f"job {job!r}: expected 1-64 letters, digits, '.', '_' or '-' (it names the job's keys "
                         f"in etcd: /shardps/<job>/shards/<i>)")
    return job


def check_coordinator(spec: str, job: str, ttl: int) -> list[str]:
    """``--coordinator``, ``--job`` and ``--coordinator-ttl`` together; the endpoints."""
    endpoints = parse_coordinator(spec)
    check_job(job)
    if ttl < 2:
        raise ValueError(f"--coordinator-ttl must be at least 2 seconds, got {ttl}")
    return endpoints
