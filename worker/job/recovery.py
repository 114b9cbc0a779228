"""Recovery after a rollback: every shard brought to one rollback epoch (``PSClient.recover``).

``choose`` is the pure decision (from the shards' ``Describe`` answers:
whether to roll back, to which checkpoint version and epoch);
``bring_together`` makes the calls and returns the shards' status after.
Idempotent: workers may recover concurrently (the shards take a rollback
to an epoch they are already in as done).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath.transport import Transport

log = logging.getLogger("shardps.worker")


def choose(stats: Sequence[ps_pb2.StatsResponse]) -> tuple[int, int] | None:
    """(version, epoch) to roll every shard back to, or None when they agree and none restarted.

    A shard that restarted from its checkpoint (``recovering``) or shards in
    different epochs (a rollback in progress) mean a rollback to the newest
    checkpoint version every shard holds; a restart also opens a new epoch.
    RuntimeError when no version is held by every shard.
    """
    epochs = [s.epoch for s in stats]
    recovering = any(s.recovering for s in stats)
    if not recovering and len(set(epochs)) <= 1:
        return None
    common = set.intersection(*(set(s.checkpoint_versions) for s in stats))
    if not common:
        held = {i: list(s.checkpoint_versions) for i, s in enumerate(stats)}
        raise RuntimeError(f"cannot recover: no checkpoint version is held by every shard ({held})")
    return max(common), max(epochs) + (1 if recovering else 0)


def bring_together(transport: Transport, worker_id: int) -> list[ps_pb2.StatsResponse]:
    """Roll every shard back when ``choose`` says so; each shard's status after (``Describe``, the worker
    token; every call within the transport's deadline)."""
    t = transport
    stats = t.each(lambda i: t.stub(i).Describe(ps_pb2.StatsRequest(), timeout=t.timeout))
    target = choose(stats)
    if target is None:
        return stats
    version, epoch = target
    log.warning("worker %d: rolling the job back to version %d (epoch %d)", worker_id, version, epoch)
    t.each(lambda i: t.stub(i).Recover(ps_pb2.RollbackRequest(version=version, epoch=epoch), timeout=t.timeout))
    return t.each(lambda i: t.stub(i).Describe(ps_pb2.StatsRequest(), timeout=t.timeout))
