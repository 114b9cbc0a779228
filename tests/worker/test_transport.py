"""The transport without a network: retries, fail-over to a backup, the fan-out, the error mapping.

Channels are fakes (tests/worker/fakes.py) that hand each call to a function
of (address, method, request); a failure is a grpc.RpcError carrying a
status, as gRPC raises.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath.transport import Transport, unary
from shardps.worker.errors import Aborted, Evicted, ShardError, Unreachable
from tests.worker.fakes import OPENED, SERVERS, Failure, FakeSecurity, fake_transport


def _stats(t: Transport) -> list[Any]:
    return t.each(lambda i: t.stub(i).Describe(ps_pb2.StatsRequest(), timeout=t.timeout))


def test_each_calls_every_shard_in_parallel_in_shard_order():
    barrier = threading.Barrier(3, timeout=5)

    def server(address: str, method: str, request: Any) -> Any:
        if isinstance(request, ps_pb2.StatsRequest):
            barrier.wait()  # all three shards are called at once, or this times out
        return ps_pb2.StatsResponse(shard_index=int(address.split(":")[1]))

    t = fake_transport(server, addresses=("a:0", "b:1", "c:2"))
    try:
        assert [r.shard_index for r in _stats(t)] == [0, 1, 2]
        checkpointed = t.each(lambda i: t.operator(i).Checkpoint(ps_pb2.CheckpointRequest()), [2])
        assert [r.shard_index for r in checkpointed] == [2]
    finally:
        t.close()


def test_an_unavailable_shard_is_retried_until_it_answers():
    calls = {"a:1": 0}

    def server(address: str, method: str, request: Any) -> Any:
        if address == "a:1" and method == "Checkpoint":
            calls[address] += 1
            if calls[address] < 3:
                raise Failure(grpc.StatusCode.UNAVAILABLE, "Connection refused")
        return ps_pb2.StatsResponse()  # also the answer to "where did your shard go?" (not deposed)

    t = fake_transport(server, recovery_timeout=10.0)
    try:
        assert len(t.each(lambda i: t.operator(i).Checkpoint(ps_pb2.CheckpointRequest()))) == 2
        assert calls["a:1"] == 3 and t.retries_total == 2 and t.failovers_total == 0
    finally:
        t.close()


def test_a_shard_unavailable_past_the_recovery_timeout_is_unreachable_with_a_hint():
    def server(address: str, method: str, request: Any) -> Any:
        if address == "b:1":
            raise Failure(grpc.StatusCode.UNAVAILABLE, "failed to connect: Connection refused")
        return ps_pb2.StatsResponse()

    t = fake_transport(server, recovery_timeout=0.2)
    try:
        with pytest.raises(Unreachable) as err:
            _stats(t)
        e = err.value
        assert (e.address, e.shard, e.code) == ("b:1", 1, grpc.StatusCode.UNAVAILABLE)
        assert "still unavailable after 0s and" in e.details
        assert "nothing listens there (connection refused): failed to connect" in e.details
        assert t.retries_total >= 1
    finally:
        t.close()


@pytest.mark.parametrize(("code", "details", "expected"), [
    (grpc.StatusCode.ABORTED, "the job was rolled back: resync", Aborted),
    (grpc.StatusCode.FAILED_PRECONDITION, "worker 0 was evicted from shard 0", Evicted),
    (grpc.StatusCode.INVALID_ARGUMENT, "bad", ShardError),
])
def test_other_failures_are_not_retried_and_keep_their_details(code, details, expected):
    calls = []

    def server(address: str, method: str, request: Any) -> Any:
        calls.append(address)
        raise Failure(code, details)

    t = fake_transport(server, addresses=("a:1",))
    try:
        with pytest.raises(expected) as err:
            _stats(t)
        assert type(err.value) is expected and err.value.details == details and calls == ["a:1"]
        with pytest.raises(expected):  # once, as the heartbeats and Leave call
            t.attempt(0, lambda: t.stub(0).Describe(ps_pb2.StatsRequest()))
        assert t.retries_total == 0
    finally:
        t.close()


def test_an_unavailable_shard_with_a_backup_fails_over_to_it():
    promoted = []

    def server(address: str, method: str, request: Any) -> Any:
        if address == "a:1":
            raise Failure(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if method == "TakeOver":
            promoted.append((address, request.reason))
            return ps_pb2.PromoteResponse(shard_index=0, version=4)
        return ps_pb2.StatsResponse(shard_index=0 if address == "a:2" else 1)

    t = fake_transport(server, backups=["a:2", ""], worker_id=3)
    try:
        assert [r.shard_index for r in _stats(t)] == [0, 1]
        assert promoted == [("a:2", "worker 3: a:1 unavailable: Socket closed")]
        assert t.addresses == ["a:2", "b:1"] and t.backups == ["", ""]
        assert t.failovers_total == 1 and t.retries_total == 0
        _stats(t)  # from now on the backup serves: no second fail-over
        assert len(promoted) == 1
    finally:
        t.close()
    sec_channels = next(chs for chs in OPENED.values() if any(c.address == "a:2" for c in chs))
    assert all(c.closed for c in sec_channels)  # the replaced channel too


def test_a_deposed_primary_names_where_its_shard_went():
    def server(address: str, method: str, request: Any) -> Any:
        if address == "a:1":
            if method == "Describe":
                if isinstance(request, ps_pb2.StatsRequest) and not hasattr(server, "asked"):
                    server.asked = True  # type: ignore[attr-defined]
                    raise Failure(grpc.StatusCode.UNAVAILABLE, "shard 0 was taken over by its backup at n:1")
                return ps_pb2.StatsResponse(role="deposed", backup="n:1")
        if method == "TakeOver":
            return ps_pb2.PromoteResponse(version=1)
        return ps_pb2.StatsResponse(shard_index=7)

    t = fake_transport(server, addresses=("a:1",))
    try:
        assert [r.shard_index for r in _stats(t)] == [7]
        assert t.addresses == ["n:1"] and t.failovers_total == 1
    finally:
        t.close()


def test_a_backup_learnt_from_an_old_stub_is_not_kept():
    t = fake_transport(lambda a, m, r: ps_pb2.StatsResponse())
    try:
        old = t.stub(0)
        t.set_backup(0, "x:1", old)
        assert t.backups == ["x:1", ""]
        t._install(0, "x:1", t.security.channel("x:1"))  # as a fail-over does
        t.set_backup(0, "y:1", old)  # a heartbeat answered by the replaced primary
        assert t.backups == ["x:1", ""]
        t.set_backup(0, "y:1", t.stub(0))
        assert t.backups == ["y:1", ""]
    finally:
        t.close()


def test_fan_out_waits_for_every_shard_then_raises_the_first_failure():
    done = []

    def fn(i: int) -> int:
        if i == 0:
            raise ValueError("first")
        done.append(i)
        return i

    t = fake_transport(lambda a, m, r: None, addresses=("a:1", "b:1", "c:1"))
    try:
        with pytest.raises(ValueError, match="first"):
            t.fan_out(fn)
        assert sorted(done) == [1, 2]
    finally:
        t.close()


def test_fan_out_runs_the_first_shard_in_the_callers_thread_and_the_others_in_the_pool():
    threads: dict[int, int] = {}

    def fn(i: int) -> int:
        threads[i] = threading.get_ident()
        return i

    t = fake_transport(lambda a, m, r: None, addresses=("a:1", "b:1", "c:1"))
    try:
        assert t.fan_out(fn) == [0, 1, 2]
        assert threads[0] == threading.get_ident()
        assert threading.get_ident() not in (threads[1], threads[2])
        assert t.fan_out(fn, [2]) == [2] and threads[2] == threading.get_ident()
        assert t.fan_out(fn, []) == []
    finally:
        t.close()


def test_backups_need_one_entry_per_shard():
    with pytest.raises(ValueError, match="one address \\(or ''\\) per shard: 2 shards, 1 backups"):
        fake_transport(lambda a, m, r: None, backups=["x:1"])


def test_an_endpoint_call_names_the_method_and_the_endpoint():
    sec = FakeSecurity()

    def server(address: str, method: str, request: Any) -> Any:
        raise Failure(grpc.StatusCode.FAILED_PRECONDITION, "the primary still answers SERVING")

    SERVERS[id(sec)] = server
    with pytest.raises(ShardError) as err:
        unary("h:9", "Promote", ps_pb2.PromoteRequest(), timeout=1.0, security=sec)
    assert str(err.value) == "h:9: FAILED_PRECONDITION: Promote: the primary still answers SERVING"
    assert err.value.shard is None
