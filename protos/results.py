"""The outcome of one push, as one typed value on both sides of the ``Push`` RPC.

The server's store returns a ``PushResult`` from ``submit``; the servicer
answers ``Push`` with ``to_proto()``; the worker reads each shard's answer
back with ``PushResult.from_proto`` (``PSClient.push`` returns one per shard).
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

    def to_proto(self) -> ps_pb2.PushResponse:
        return ps_pb2.PushResponse(version=self.version, applied=self.applied, duplicate=self.duplicate,
                                   sync=self.sync, loss_scale=self.loss_scale, ready_version=self.ready_version)

    @classmethod
    def from_proto(cls, r: ps_pb2.PushResponse) -> PushResult:
        return cls(version=r.version, applied=r.applied, duplicate=r.duplicate, sync=r.sync,
                   loss_scale=r.loss_scale, ready_version=r.ready_version)
