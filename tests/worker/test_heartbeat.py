"""Heartbeats without a network: they beat every shard, learn backups, survive failures, and stop."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.job.heartbeat import Heartbeats
from tests.worker.fakes import Failure, fake_transport


def test_heartbeats_renew_every_shard_learn_backups_and_stop():
    beats: list[tuple[str, int]] = []
    seen = threading.Event()

    def server(address: str, method: str, request: Any) -> Any:
        assert method == "Heartbeat"
        beats.append((address, request.worker_id))
        if address == "b:1":
            seen.set()
            raise Failure(grpc.StatusCode.UNAVAILABLE, "Connection refused")  # logged; the next shard goes on
        return ps_pb2.HeartbeatResponse(backup="n:1")

    t = fake_transport(server, addresses=("a:1", "b:1"))
    hb = Heartbeats(t, worker_id=4)
    try:
        assert not hb.running
        hb.start(0.01)
        hb.start(0.01)  # once
        assert seen.wait(10)
        assert ("a:1", 4) in beats and ("b:1", 4) in beats
        assert t.backups == ["n:1", ""]  # learnt from shard 0's answer
        hb.stop()
        assert hb._thread is not None and not hb._thread.is_alive()
        n = len(beats)
        time.sleep(0.05)
        assert len(beats) == n  # stopped
        assert t.retries_total == 0  # heartbeats are tried once, never retried
    finally:
        hb.stop()
        t.close()


def test_a_stop_before_start_leaves_no_beating_thread():
    t = fake_transport(lambda a, m, r: ps_pb2.HeartbeatResponse())
    hb = Heartbeats(t, worker_id=0)
    hb.stop()
    hb.start(0.01)
    hb._thread.join(5)
    assert not hb._thread.is_alive()
    t.close()


def test_a_register_under_way_keeps_the_lease_of_the_shards_that_answered_it_and_only_theirs():
    """One shard slow to answer a Register (a fail-over) must not let the lease run out on the others: each shard
    is beaten from its answer on (at a third of the shortest lease answered), the rest once the Register is done."""
    beats: list[str] = []
    second, first = threading.Event(), threading.Event()

    def server(address: str, method: str, request: Any) -> Any:
        beats.append(address)
        if beats.count("b:1") >= 2:
            second.set()
        if address == "a:1":
            first.set()
        return ps_pb2.HeartbeatResponse()

    t = fake_transport(server, addresses=("a:1", "b:1", "c:1"))
    hb = Heartbeats(t, worker_id=1)
    try:
        hb.joined(1, 0.03)  # shard 1 answered; shards 0 and 2 not yet
        assert hb._round() == (0.01, [1])
        assert second.wait(10)
        assert set(beats) == {"b:1"}
        hb.joined(2, 0.6)
        assert hb._round() == (0.01, [1, 2])  # the shortest lease sets the pace
        hb.start(0.02)  # the Register done: every shard, at the lease the client took
        assert hb._round() == (0.02, None)
        hb.joined(0, 0.3)  # too late to change anything
        assert hb._round() == (0.02, None)
        assert first.wait(10)  # shard 0 beaten at last
    finally:
        hb.stop()
        t.close()
