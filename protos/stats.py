"""A shard's statistics as one typed value, on both sides of the ``Stats`` RPC.

The server builds a ``ShardStats`` from its store (``ShardStore.stats()``)
and answers ``Stats`` with ``to_proto()``; its metrics read the same value.
A client reads the answer back with ``ShardStats.from_proto`` and, for the
CLI and JSON output, ``to_dict()`` (the plain-values shape
``PSClient.stats()`` returns). ``pulls_total``, ``staleness_remedy`` and
``promotions_total`` are the server's own (not on the wire: 0 and "" after
``from_proto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardps.protos import codec
from shardps.protos.shardps.v1 import ps_pb2


@dataclass(frozen=True)
class TensorStats:
    spec: ps_pb2.TensorSpec  # as registered (the wire form)
    weight_bytes: int
    optimizer_state_bytes: int

    @property
    def name(self) -> str:
        return self.spec.name


#: The counts of a row table in Stats (``RowTableStats``), in the proto's order.
ROW_TABLE_COUNTS = ("rows", "weight_bytes", "state_bytes", "index_bytes", "steps", "admitted", "dropped", "expired",
                    "duplicates", "pending_admission", "skipped")


@dataclass(frozen=True)
class RowTableStats:
    """One row table on a shard (server/rows/tables.py ``RowTables.stats``)."""

    spec: ps_pb2.RowTableSpec  # as registered (the wire form)
    counts: dict[str, int]  # ROW_TABLE_COUNTS
    staleness_counts: dict[int, int] = field(default_factory=dict)  # row staleness -> rows pushed with it

    @property
    def name(self) -> str:
        return self.spec.name

    def to_proto(self) -> ps_pb2.RowTableStats:
        return ps_pb2.RowTableStats(spec=self.spec, staleness_counts=self.staleness_counts,
                                    **{k: self.counts.get(k, 0) for k in ROW_TABLE_COUNTS})

    @classmethod
    def from_proto(cls, r: ps_pb2.RowTableStats) -> RowTableStats:
        return cls(r.spec, {k: int(getattr(r, k)) for k in ROW_TABLE_COUNTS},
                   {int(k): int(v) for k, v in r.staleness_counts.items()})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.spec.name, "dim": self.spec.dim, "optimizer": self.spec.optimizer.name,
                **{k: self.counts.get(k, 0) for k in ROW_TABLE_COUNTS},
                "staleness_counts": dict(self.staleness_counts)}


@dataclass(frozen=True)
class ShardStats:
    shard_index: int
    num_shards: int
    version: int = 0
    sync: str = ""
    num_workers: int = 0
    registered_workers: list[int] = field(default_factory=list)
    evicted_workers: list[int] = field(default_factory=list)
    evictions_total: int = 0
    left_workers: list[int] = field(default_factory=list)
    leaves_total: int = 0
    epoch: int = 0
    recovering: bool = False
    waiting_pulls: int = 0
    tensors: list[TensorStats] = field(default_factory=list)
    pushes_total: int = 0
    applied_updates_total: int = 0
    gradients_applied_total: int = 0
    push_bytes_total: int = 0
    pull_bytes_total: int = 0
    pulls_total: int = 0
    staleness_counts: dict[int, int] = field(default_factory=dict)
    skipped_steps_total: int = 0
    sync_switches_total: int = 0
    staleness_remedy: str = ""
    checkpoint_versions: list[int] = field(default_factory=list)
    duplicate_pushes_total: int = 0
    loss_scale: float = 0.0
    worker_clocks: dict[int, int] = field(default_factory=dict)  # last step pushed per worker
    role: str = ""
    backup: str = ""
    replica_state: str = "none"
    replicated_ops_total: int = 0
    replication_lag_ops: int = 0
    promotions_total: int = 0
    push_received_bytes_total: int = 0  # Push messages as received (refused ones included)
    row_tables: list[RowTableStats] = field(default_factory=list)  # the row tables held here (docs/sparse.md)

    def to_proto(self) -> ps_pb2.StatsResponse:
        return ps_pb2.StatsResponse(
            shard_index=self.shard_index, num_shards=self.num_shards, version=self.version,
            sync=self.sync, num_workers=self.num_workers, registered_workers=self.registered_workers,
            tensors=[ps_pb2.TensorStats(spec=t.spec, weight_bytes=t.weight_bytes,
                                        optimizer_state_bytes=t.optimizer_state_bytes) for t in self.tensors],
            pushes_total=self.pushes_total, applied_updates_total=self.applied_updates_total,
            gradients_applied_total=self.gradients_applied_total,
            push_bytes_total=self.push_bytes_total, pull_bytes_total=self.pull_bytes_total,
            staleness_counts=self.staleness_counts, worker_clocks=self.worker_clocks,
            skipped_steps_total=self.skipped_steps_total, loss_scale=self.loss_scale,
            duplicate_pushes_total=self.duplicate_pushes_total,
            sync_switches_total=self.sync_switches_total, checkpoint_versions=self.checkpoint_versions,
            evicted_workers=self.evicted_workers, evictions_total=self.evictions_total, epoch=self.epoch,
            recovering=self.recovering, waiting_pulls=self.waiting_pulls, role=self.role, backup=self.backup,
            replica_state=self.replica_state, replicated_ops_total=self.replicated_ops_total,
            replication_lag_ops=self.replication_lag_ops, left_workers=self.left_workers,
            leaves_total=self.leaves_total, push_received_bytes_total=self.push_received_bytes_total,
            row_tables=[t.to_proto() for t in self.row_tables])

    @classmethod
    def from_proto(cls, r: ps_pb2.StatsResponse) -> ShardStats:
        return cls(
            shard_index=r.shard_index, num_shards=r.num_shards, version=int(r.version), sync=r.sync,
            num_workers=r.num_workers, registered_workers=list(r.registered_workers),
            evicted_workers=list(r.evicted_workers), evictions_total=int(r.evictions_total),
            left_workers=list(r.left_workers), leaves_total=int(r.leaves_total), epoch=int(r.epoch),
            recovering=bool(r.recovering), waiting_pulls=int(r.waiting_pulls),
            tensors=[TensorStats(t.spec, int(t.weight_bytes), int(t.optimizer_state_bytes)) for t in r.tensors],
            pushes_total=int(r.pushes_total), applied_updates_total=int(r.applied_updates_total),
            gradients_applied_total=int(r.gradients_applied_total), push_bytes_total=int(r.push_bytes_total),
            pull_bytes_total=int(r.pull_bytes_total),
            staleness_counts={int(k): int(v) for k, v in r.staleness_counts.items()},
            skipped_steps_total=int(r.skipped_steps_total), sync_switches_total=int(r.sync_switches_total),
            checkpoint_versions=[int(v) for v in r.checkpoint_versions],
            duplicate_pushes_total=int(r.duplicate_pushes_total), loss_scale=float(r.loss_scale),
            worker_clocks={int(k): int(v) for k, v in r.worker_clocks.items()}, role=r.role, backup=r.backup,
            replica_state=r.replica_state, replicated_ops_total=int(r.replicated_ops_total),
            replication_lag_ops=int(r.replication_lag_ops), push_received_bytes_total=int(r.push_received_bytes_total),
            row_tables=[RowTableStats.from_proto(t) for t in r.row_tables])

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values in the shape ``PSClient.stats()`` gives (the CLI's JSON)."""
        return {
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "sync": self.sync,
            "num_workers": self.num_workers,
            "registered_workers": list(self.registered_workers),
            "tensors": [
                {
                    "name": t.spec.name,
                    "shape": tuple(t.spec.shape),
                    "dtype": codec.dtype_name(t.spec.dtype),
                    "optimizer": t.spec.optimizer.name,
                    "parts": [(p.start, p.stop) for p in t.spec.parts],
                    "weight_bytes": t.weight_bytes,
                    "optimizer_state_bytes": t.optimizer_state_bytes,
                }
                for t in self.tensors
            ],
            "staleness_counts": dict(self.staleness_counts),
            "worker_clocks": dict(self.worker_clocks),
            "skipped_steps_total": self.skipped_steps_total,
            "duplicate_pushes_total": self.duplicate_pushes_total,
            "loss_scale": self.loss_scale,
            "sync_switches_total": self.sync_switches_total,
            "checkpoint_versions": list(self.checkpoint_versions),
            "evicted_workers": list(self.evicted_workers),
            "evictions_total": self.evictions_total,
            "left_workers": list(self.left_workers),
            "leaves_total": self.leaves_total,
            "epoch": self.epoch,
            "recovering": self.recovering,
            "waiting_pulls": self.waiting_pulls,
            "role": self.role,
            "backup": self.backup,
            "replica_state": self.replica_state,
            "replicated_ops_total": self.replicated_ops_total,
            "replication_lag_ops": self.replication_lag_ops,
            "version": self.version,
            "pushes_total": self.pushes_total,
            "applied_updates_total": self.applied_updates_total,
            "gradients_applied_total": self.gradients_applied_total,
            "push_bytes_total": self.push_bytes_total,
            "push_received_bytes_total": self.push_received_bytes_total,
            "pull_bytes_total": self.pull_bytes_total,
            "row_tables": [t.to_dict() for t in self.row_tables],
        }
