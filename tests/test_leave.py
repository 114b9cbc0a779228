"""A worker that finishes says goodbye: no eviction, no alert, barriers go on without it.
And a PSClient driven by hand keeps its lease while it waits (heartbeats start when it registers)."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

import shardps
from shardps.server.errors import FailedPrecondition
from shardps.server.store import ShardStore
from tests.helpers import on_return, run_workers
from tests.test_leases import _store


def test_a_leave_completes_the_round_with_the_others_and_is_no_eviction(caplog):
    caplog.set_level(logging.INFO, logger="shardps.server")
    st = _store(lease=60.0)
    st.path.submit(0, 0, 0, {("w", 0): torch.tensor([1.0, 1.0])})
    st.path.submit(1, 0, 0, {("w", 0): torch.tensor([3.0, 3.0])})
    assert st.job.version == 0
    assert st.leases.leave(2) is True
    assert st.job.version == 1 and torch.equal(st.reader.weights("w")[0], torch.tensor([-2.0, -2.0]))
    s = st.stats()
    assert s.left_workers == [2] and s.leaves_total == 1 and s.evictions_total == 0
    assert "worker 2 left" in caplog.text and "evicted" not in caplog.text
    assert st.leases.leave(2) is False and st.stats().leaves_total == 1  # idempotent
    with pytest.raises(FailedPrecondition, match="worker 2 left the job"):
        st.path.submit(2, 0, 0, {("w", 0): torch.ones(2)})
    st.leases.register(2)  # rejoins: rounds wait for it again
    st.path.submit(0, 1, 1, {("w", 0): torch.ones(2)})
    st.path.submit(1, 1, 1, {("w", 0): torch.ones(2)})
    assert st.job.version == 1
    st.path.submit(2, 0, 1, {("w", 0): torch.ones(2)})
    assert st.job.version == 2 and st.stats().left_workers == []


def test_after_everyone_left_the_next_run_expects_every_worker_again():
    """A job resumed from a checkpoint taken after its workers left: the first worker back must not
    complete rounds on its own while the others are still registering."""
    st = _store(workers=2, lease=60.0)
    st.leases.leave(0)
    st.leases.leave(1)
    st.leases.register(0)
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(2)})
    assert st.job.version == 0 and st.leases.live() == {0, 1}  # waits for worker 1
    st.leases.register(1)
    st.path.submit(1, 0, 0, {("w", 0): torch.ones(2)})
    assert st.job.version == 1


def test_an_evicted_worker_that_comes_back_after_the_others_finished_does_not_wait_for_them():
    """Review finding: when every registered worker had left, the next registration expected all workers
    again, even one that was evicted and came back to finish: it waited for workers that were done."""
    st = _store(workers=3, lease=60.0)
    st.leases.membership.last_seen[1] = time.monotonic() - 120
    assert st.leases.evict_expired() == [1]
    st.leases.leave(0)
    st.leases.leave(2)
    st.leases.register(1)
    assert st.leases.live() == {1}
    st.path.submit(1, 0, 0, {("w", 0): torch.ones(2)})
    assert st.job.version == 1


def test_leaving_releases_ssp_clocks():
    st = _store(workers=2, sync="ssp:1", lease=60.0)
    for step in range(3):
        st.path.submit(0, step, st.job.version, {("w", 0): torch.ones(2)})
    with pytest.raises(shardps.server.errors.DeadlineExceeded, match="behind: {1: 0}"):
        st.job.wait_clock(3, timeout=0.05)
    st.leases.leave(1)
    assert st.job.wait_clock(3, timeout=0.05) == 3


def test_membership_after_leaving_survives_a_snapshot():
    st = _store(lease=60.0)
    st.leases.leave(1)
    copy = ShardStore(0, 1, lease_s=60.0)
    copy.restore(*st.snapshot())
    assert copy.stats().left_workers == [1] and copy.leases.live() == {0, 2}


@pytest.mark.cluster
def test_a_clean_run_ends_with_goodbyes_not_evictions(make_cluster, caplog):
    caplog.set_level(logging.WARNING, logger="shardps.server")
    cluster = make_cluster(2, lease_s=60.0)

    def worker(k: int) -> None:
        model = torch.nn.Linear(4, 2)
        with shardps.connect(cluster.addresses, worker_id=k, num_workers=2) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
            for step in range(5):
                model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
                opt.step()
                opt.zero_grad()

    run_workers(worker, 2)
    for store in cluster.stores:
        s = store.stats()
        assert s.left_workers == [0, 1] and s.leaves_total == 2
        assert s.evictions_total == 0 and s.registered_workers == []
        # Nobody is left to be evicted later: the documented alert cannot fire for a finished job.
        assert store.leases.evict_expired(now=float("inf")) == []
    assert "evicted" not in caplog.text


def _after_heartbeat(handler, done):  # type: ignore[no-untyped-def]
    """``handler`` (a Heartbeat's) calling ``done(request, arrived)`` once it has returned: the lease renewed."""
    arrived = time.monotonic()
    return on_return(handler, lambda request: done(request, arrived))


class _CountHeartbeats(grpc.ServerInterceptor):
    """Counts the Heartbeats a server has handled: ``times`` holds each one's arrival, appended once its
    handler has returned (the lease renewed), so that a test reads the lease after the renewal, not between
    a Heartbeat's arrival and its handling."""

    def __init__(self) -> None:
        self.times: list[float] = []  # monotonic arrival times of handled Heartbeat RPCs
        self.cond = threading.Condition()

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith("/Heartbeat"):
            return handler
        return _after_heartbeat(handler, self._handled)

    def _handled(self, request, arrived: float) -> None:  # type: ignore[no-untyped-def]
        with self.cond:
            self.times.append(arrived)
            self.cond.notify_all()


@pytest.mark.fault
@pytest.mark.cluster
def test_a_client_driven_by_hand_keeps_its_lease_while_it_waits(make_cluster):
    """Found by a new user: without DistributedOptimizer no heartbeats ran, and a PSClient that
    registered and then waited (for data, for the other workers) was evicted.

    Leases are checked here at explicit moments (the background check is stopped) and measured from the
    lease's own renewal, so the outcome does not depend on how promptly a loaded machine runs the heartbeat
    thread or a Heartbeat's handler (a check made between a Heartbeat's arrival and its handling read the
    renewal before it, which, with the heartbeats late on a loaded machine, was over half a lease old)."""
    beats = _CountHeartbeats()
    cluster = make_cluster(1, lease_s=0.6, interceptors=[beats])
    store = cluster.stores[0]
    store.leases.stop_reaper()
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=0.1), sync="bsp")
        with beats.cond:  # heartbeats come without any Push or Pull
            assert beats.cond.wait_for(lambda: len(beats.times) >= 3, timeout=120)
            third = beats.times[2]
        # Each heartbeat renewed the lease (nothing else reached the shard since Register): the renewal is the
        # third one's or a later one's, and half a lease after it the worker is still live.
        renewed = store.leases.membership.last_seen[0]
        assert renewed >= third
        assert store.leases.evict_expired(now=renewed + 0.3) == [] and 0 in store.leases.live()
        client.stop_heartbeats()  # now it falls silent: once its lease has run out it is evicted
        assert store.leases.evict_expired(now=time.monotonic() + 1.2) == [0]
        assert store.stats().evicted_workers == [0]


class _HoldFirstRegister(grpc.ServerInterceptor):
    """Once armed, holds the first Register it sees (on one of the servers) until released, and counts the
    Heartbeats every server has handled (``beats``: each one's worker and arrival, appended once its handler
    has returned, as ``_CountHeartbeats`` does)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.armed = self.holding = False
        self.released = threading.Event()
        self.beats: list[tuple[int, float]] = []

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if method.endswith("/Heartbeat"):
            handler = continuation(handler_call_details)
            return handler if handler is None else _after_heartbeat(handler, self._handled)
        hold = False
        with self.cond:
            if method.endswith("/Register") and self.armed and not self.holding:
                self.holding = hold = True
            self.cond.notify_all()
        if hold:
            assert self.released.wait(120)
        return continuation(handler_call_details)

    def _handled(self, request, arrived: float) -> None:  # type: ignore[no-untyped-def]
        with self.cond:
            self.beats.append((request.worker_id, arrived))
            self.cond.notify_all()

    def of(self, worker_id: int) -> list[float]:
        return [t for w, t in self.beats if w == worker_id]


@pytest.mark.fault
@pytest.mark.cluster
def test_a_register_slow_on_one_shard_keeps_the_lease_on_the_shards_that_answered(make_cluster):
    """One shard slow to answer a Register (here held; a fail-over, in a partition) must not let the worker's
    lease run out on the shards that answered at once: its first push there would be refused as evicted and
    its step lost. Those shards are beaten as they answer. Leases are checked at explicit moments (the reapers
    stopped), so the outcome does not depend on how promptly a loaded machine runs the heartbeat thread."""
    hold = _HoldFirstRegister()
    cluster = make_cluster(2, lease_s=0.6, interceptors=[hold])
    for store in cluster.stores:
        store.leases.stop_reaper()
    tensors = {"a": torch.zeros(64), "b": torch.zeros(64), "c": torch.zeros(64)}
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2) as first:
        first.register(tensors, shardps.optim.SGD(lr=0.1), sync="bsp")  # every shard holds its tensors
        first.stop_heartbeats()  # the beats counted below are the registering worker's
        with shardps.connect(cluster.addresses, worker_id=1, num_workers=2) as client:
            hold.armed = True
            registering = threading.Thread(target=client.register, args=(tensors, shardps.optim.SGD(lr=0.1)),
                                           kwargs={"sync": "bsp"})
            registering.start()
            try:
                with hold.cond:  # one shard holds the Register; the other answered, and is beaten meanwhile
                    assert hold.cond.wait_for(lambda: hold.holding and len(hold.of(1)) >= 3, timeout=120)
                    third = hold.of(1)[2]
                answered = [s for s in cluster.stores if 1 in s.leases.membership.workers]
                assert len(answered) == 1
                # The beats renewed the lease there (its renewal is the third one's or a later one's; measured
                # from it, not from a beat's arrival, which a loaded machine may handle late): half a lease
                # after it, the worker is still live there.
                renewed = answered[0].leases.membership.last_seen[1]
                assert renewed >= third
                assert 1 not in answered[0].leases.membership.expired(now=renewed + 0.3)
            finally:
                hold.released.set()
                registering.join(60)
            assert not registering.is_alive()
            assert all(1 in s.leases.membership.workers for s in cluster.stores)
            assert all(s.stats().evictions_total == 0 for s in cluster.stores)
