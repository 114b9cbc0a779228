"""What the store answers for a worker's Push and Register, one typed value each.

The server's store returns a ``PushResult`` from ``submit`` and a
``Registered`` from ``join``; the servicer answers with ``to_proto()``. The
worker reads each shard's Push answer back with ``PushResult.from_proto``
(``PSClient.push`` returns one per shard).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardps.protos.shardps.v1 import ps_pb2


@dataclass(frozen=True)
class PushResult:
    version: int  # the shard's version once the push was taken in
    applied: bool  # an optimizer step ran as a result of this push
    duplicate: bool  # (worker_id, step) was already taken in: ignored
    sync: str = ""  # the shard's sync mode (workers follow a live switch from it)
    loss_scale: float = 0.0  # the scale to use next (0 when loss scaling is off)
    ready_version: int = 0  # the first version that includes the gradient pushed
    pulled: tuple[bytes, ...] = ()  # asked with pull_after: the shard's weights as serialized PullResponses
    sync_switch: int = 0  # the job's sync switch ``sync`` came from (0: its first mode)

    def to_proto(self) -> ps_pb2.PushResponse:
        return ps_pb2.PushResponse(version=self.version, applied=self.applied, duplicate=self.duplicate,
                                   sync=self.sync, loss_scale=self.loss_scale, ready_version=self.ready_version,
                                   pulled=list(self.pulled), sync_switch=self.sync_switch)

    @classmethod
    def from_proto(cls, r: ps_pb2.PushResponse) -> PushResult:
        return cls(version=r.version, applied=r.applied, duplicate=r.duplicate, sync=r.sync,
                   loss_scale=r.loss_scale, ready_version=r.ready_version, pulled=tuple(r.pulled),
                   sync_switch=r.sync_switch)


@dataclass(frozen=True)
class Registered:
    """A shard's answer to a worker's Register: where the job stands for it."""

    version: int
    shard_index: int
    num_shards: int
    sync: str  # the mode in force (the job's: it may have been switched since)
    created: list[str]  # tensors this Register created (worker 0's initial values)
    loss_scale: float
    worker_clock: int  # the next step this worker pushes (0 for a new worker)
    lease_seconds: float
    epoch: int
    backup: str  # the backup's address, "" without one
    sync_switch: int = 0  # the job's sync switch ``sync`` came from (0: its first mode)
    skips: bool = False  # the worker was evicted here: its next push may skip its clock ahead
    ready_version: int = 0  # from which version the worker's last gradient is in (version + 1 while held)

    def to_proto(self) -> ps_pb2.RegisterResponse:
        return ps_pb2.RegisterResponse(
            version=self.version, shard_index=self.shard_index, num_shards=self.num_shards, sync=self.sync,
            created=self.created, loss_scale=self.loss_scale, worker_clock=self.worker_clock,
            lease_seconds=self.lease_seconds, epoch=self.epoch, backup=self.backup, sync_switch=self.sync_switch,
            skips=self.skips, ready_version=self.ready_version)
