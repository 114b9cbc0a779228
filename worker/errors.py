"""What can go wrong talking to the shards, as types.

``ShardError`` is the base of every failed RPC: it carries the shard's
address, its index (None for an endpoint of no known shard), the gRPC status
code (a ``grpc.StatusCode``) and the server's details. The transport turns a
gRPC failure into one of these once (``shard_error``); the rest of the worker
matches on the type, never on message text:

| status | details | type | means |
| --- | --- | --- | --- |
| UNAVAILABLE | any | ``Unreachable`` | the shard did not answer (after retries and fail-over) |
| ABORTED | any | ``Aborted`` | the job was rolled back or a shard restarted from its checkpoint: resync |
| FAILED_PRECONDITION | "... was evicted ..." | ``Evicted`` | this worker's lease expired: register again |
| anything else | any | ``ShardError`` | |

``RolledBack`` is not a shard's failure: ``DistributedOptimizer.step()``
raises it to the training loop after it resynced from a rollback.
"""

from __future__ import annotations

from enum import Enum


class ShardError(RuntimeError):
    """An RPC to one shard failed: ``code`` is the grpc.StatusCode (``shard`` None: an endpoint of no known shard)."""

    def __init__(self, address: str, shard: int | None, code: Enum, details: str) -> None:
        where = f"shard {shard} ({address})" if shard is not None else address
        super().__init__(f"{where}: {code.name}: {details}")
        self.address, self.shard, self.code, self.details = address, shard, code, details


class Unreachable(ShardError):
    """UNAVAILABLE: the shard did not answer, after the retries and fail-over the client allows."""


class Aborted(ShardError):
    """ABORTED: the job was rolled back (or a shard restarted from its checkpoint); resync and redo."""


class Evicted(ShardError):
    """FAILED_PRECONDITION, evicted: this worker's lease expired and the others went on; register again."""


# The server's words for an eviction (server/store.py, _check_registered): the wire carries no other sign.
EVICTED_MARK = "was evicted"


def error_type(code_name: str, details: str) -> type[ShardError]:
    """The ShardError subclass for a gRPC status (by name) and the server's details."""
    if code_name == "UNAVAILABLE":
        return Unreachable
    if code_name == "ABORTED":
        return Aborted
    if code_name == "FAILED_PRECONDITION" and EVICTED_MARK in details:
        return Evicted
    return ShardError


def shard_error(address: str, shard: int | None, code: Enum, details: str) -> ShardError:
    """The typed error for a failed RPC to ``shard`` at ``address``."""
    return error_type(code.name, details)(address, shard, code, details)


class RolledBack(Exception):
    """The job was rolled back to a checkpoint: redo training from optimizer step ``step``.

    The model already holds the weights of that step. Catch it in the
    training loop and move the data back::

        step = 0
        while step < total:
            try:
                train_one_step(step)   # forward, backward, opt.step()
                step += 1
            except shardps.RolledBack as e:
                step = e.step
    """

    def __init__(self, step: int, worker_id: int) -> None:
        super().__init__(f"worker {worker_id}: the job rolled back; go on from step {step}")
        self.step = step
