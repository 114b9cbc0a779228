"""The operator's calls to a running job: stats, set_sync, checkpoint, promote, attach_replica, health.

Not on the worker's data path. ``stats``, ``set_sync`` and ``checkpoint``
act on every shard of a transport (``worker/datapath/transport.py``) through each
shard's ``Operator`` service, with the operator token
(``SHARDPS_OPERATOR_TOKEN``, else the shared one); ``promote``,
``attach_replica`` and ``health`` talk to one endpoint by address. Every
call has a deadline; a failure raises a ``ShardError``. The commands that
print them (``shardps ctl``, ``shardps stats``, ``shardps health``) are
``shardps/admin.py``'s; ``PSClient.set_sync()`` and ``.checkpoint()`` call
these.
"""

from __future__ import annotations

from typing import Any

from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.stats import ShardStats
from shardps.worker.datapath.reach import health_status
from shardps.worker.datapath.transport import Transport, unary

__all__ = ["attach_replica", "checkpoint", "health", "promote", "set_sync", "stats"]


def stats(transport: Transport) -> list[dict[str, Any]]:
    """Per-shard status as plain dicts: version, tensors, bytes, counters, staleness counts."""
    t = transport
    res = t.each(lambda i: t.operator(i).Stats(ps_pb2.StatsRequest(), timeout=t.timeout))
    return [ShardStats.from_proto(r).to_dict() for r in res]


def describe(transport: Transport) -> list[dict[str, Any]]:
    """``stats`` read with the worker token (``Workers.Describe``): what ``PSClient.stats`` answers."""
    t = transport
    return [ShardStats.from_proto(r).to_dict()
            for r in t.each(lambda i: t.stub(i).Describe(ps_pb2.StatsRequest(), timeout=t.timeout))]


def set_sync(transport: Transport, sync: str) -> list[str]:
    """Switch the running job's sync mode on every shard; workers follow from their next step.

    Returns the mode each shard now runs, in shard order.
    """
    return [r.sync for r in switch_sync(transport, sync)]


def switch_sync(transport: Transport, sync: str) -> list[ps_pb2.SetSyncResponse]:
    """``set_sync``, answering with each shard's whole SetSyncResponse (the job's sync switch too)."""
    t = transport
    return t.each(lambda i: t.operator(i).SetSync(ps_pb2.SetSyncRequest(sync=sync), timeout=t.timeout,
                                              wait_for_ready=True))


def checkpoint(transport: Transport) -> list[tuple[int, str]]:
    """Ask every shard to write a checkpoint now: [(version, path)] per shard."""
    t = transport
    res = t.each(lambda i: t.operator(i).Checkpoint(ps_pb2.CheckpointRequest(), timeout=t.timeout))
    return [(r.version, r.path) for r in res]


def promote(address: str, *, force: bool = False, reason: str = "shardps ctl promote", timeout: float = 30.0,
            security: Security | None = None) -> ps_pb2.PromoteResponse:
    """Make the backup at ``address`` (a server's replica port) serve its shard."""
    r: ps_pb2.PromoteResponse = unary(address, "Promote", ps_pb2.PromoteRequest(reason=reason, force=force),
                                      timeout=timeout, security=security)
    return r


def attach_replica(address: str, target: str, *, timeout: float = 30.0, security: Security | None = None,
                   wait_for_ready: bool = False) -> ps_pb2.AttachReplicaResponse:
    """Give the shard at ``address`` a backup at ``target``; waits up to ``timeout`` for it to sync.

    ``wait_for_ready``: wait (within the deadline) for the server at
    ``address`` to accept a connection, rather than fail at once (a server
    still coming up).
    """
    r: ps_pb2.AttachReplicaResponse = unary(
        address, "AttachReplica", ps_pb2.AttachReplicaRequest(address=target, timeout_seconds=timeout),
        timeout=timeout + 5, security=security, wait_for_ready=wait_for_ready)
    return r


def health(address: str, *, service: str = "", timeout: float = 5.0,
           security: Security | None = None) -> tuple[str, bool]:
    """The gRPC health check of ``address`` for ``service``: (status name, whether SERVING).

    A server that does not answer within ``timeout`` raises a ``ShardError``.
    """
    return health_status(address, service=service, timeout=timeout, security=security)
