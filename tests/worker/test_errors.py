"""The error mapping table: a gRPC status and the server's details -> the ShardError type (no network)."""

from __future__ import annotations

import grpc
import pytest

import shardps
from shardps.worker import errors, optimizer
from shardps.worker.client import ShardError as ClientShardError
from shardps.worker.errors import Aborted, Evicted, RolledBack, ShardError, Unreachable, shard_error

EVICTED = "worker 1 was evicted from shard 0 (its lease of 10.0s expired): register again to rejoin"
LEFT = "worker 1 left the job on shard 0: register again to rejoin"


@pytest.mark.parametrize(("code", "details", "expected"), [
    (grpc.StatusCode.UNAVAILABLE, "Connection refused", Unreachable),
    (grpc.StatusCode.UNAVAILABLE, "shard 0 was taken over by its backup at h:1", Unreachable),
    (grpc.StatusCode.ABORTED, "the job was rolled back (shard 0 is in epoch 2, the request in 1): resync", Aborted),
    (grpc.StatusCode.ABORTED, "shard 1 restarted from its checkpoint at version 7: ...", Aborted),
    (grpc.StatusCode.FAILED_PRECONDITION, EVICTED, Evicted),
    (grpc.StatusCode.FAILED_PRECONDITION, LEFT, ShardError),
    (grpc.StatusCode.FAILED_PRECONDITION, "shard 0 has no job yet: register first", ShardError),
    (grpc.StatusCode.INVALID_ARGUMENT, EVICTED, ShardError),  # the words count only with their status
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ShardError),
    (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token", ShardError),
    (grpc.StatusCode.UNKNOWN, "", ShardError),
])
def test_status_and_details_map_to_one_type(code, details, expected):
    e = shard_error("h:1", 3, code, details)
    assert type(e) is expected
    assert isinstance(e, ShardError) and isinstance(e, RuntimeError)  # callers that catch the base catch all
    assert (e.address, e.shard, e.code, e.details) == ("h:1", 3, code, details)
    assert str(e) == f"shard 3 (h:1): {code.name}: {details}"


def test_an_endpoint_of_no_shard_is_named_by_its_address():
    e = shard_error("127.0.0.1:1", None, grpc.StatusCode.UNAVAILABLE, "Promote: Connection refused")
    assert str(e) == "127.0.0.1:1: UNAVAILABLE: Promote: Connection refused"


def test_the_public_names_stay_where_users_import_them():
    assert shardps.ShardError is ShardError is ClientShardError is errors.ShardError
    assert shardps.RolledBack is RolledBack is optimizer.RolledBack
    assert not issubclass(RolledBack, ShardError)  # raised to the training loop, not by a shard
    e = RolledBack(12, worker_id=1)
    assert e.step == 12 and str(e) == "worker 1: the job rolled back; go on from step 12"
