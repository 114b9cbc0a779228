"""Leases and membership as tables: a fake clock, no network, no threads."""

from __future__ import annotations

import pytest

from shardps.server.errors import FailedPrecondition, InvalidArgument
from shardps.server.membership import Membership


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _members(n: int = 3, lease: float = 10.0) -> tuple[Membership, FakeClock]:
    clock = FakeClock()
    m = Membership(0, lease, clock)
    m.num_workers = n
    return m, clock


# Each case: events, then the workers evicted by the last "check" and the live set after it.
# Events: ("reg", w), ("touch", w), ("leave", w), ("at", t): the clock reads t, ("check",): evict the expired.
EVICTION_TABLE = [
    ("nobody registered, nothing expires", [("at", 1000.0), ("check",)], [], {0, 1, 2}),
    ("within the lease", [("reg", 0), ("at", 110.0), ("check",)], [], {0, 1, 2}),
    ("exactly at the lease is not past it", [("reg", 0), ("at", 110.0), ("check",)], [], {0, 1, 2}),
    ("past the lease", [("reg", 0), ("at", 110.5), ("check",)], [0], {1, 2}),
    ("a touch renews", [("reg", 0), ("at", 108.0), ("touch", 0), ("at", 117.0), ("check",)], [], {0, 1, 2}),
    ("only the silent one", [("reg", 0), ("reg", 1), ("at", 105.0), ("touch", 1), ("at", 111.0), ("check",)],
     [0], {1, 2}),
    ("all silent, in order", [("reg", 2), ("reg", 0), ("at", 200.0), ("check",)], [0, 2], {1}),
    ("one that left is not evicted", [("reg", 0), ("leave", 0), ("at", 500.0), ("check",)], [], {1, 2}),
    ("a touch of an unregistered worker holds no lease", [("touch", 1), ("at", 500.0), ("check",)], [], {0, 1, 2}),
    ("an evicted worker rejoins with a fresh lease",
     [("reg", 0), ("at", 111.0), ("check",), ("reg", 0), ("at", 120.0), ("check",)], [], {0, 1, 2}),
    ("evicted again after its new lease", [("reg", 0), ("at", 111.0), ("check",), ("reg", 0), ("at", 121.5),
                                           ("check",)], [0], {1, 2}),
]


@pytest.mark.parametrize("events, evicted, live", [c[1:] for c in EVICTION_TABLE],
                         ids=[c[0] for c in EVICTION_TABLE])
def test_eviction_table(events, evicted, live):
    m, clock = _members()
    last: list[int] = []
    for ev in events:
        if ev[0] == "reg":
            m.register(ev[1])
        elif ev[0] == "touch":
            m.touch(ev[1])
        elif ev[0] == "leave":
            m.leave(ev[1])
        elif ev[0] == "at":
            clock.now = ev[1]
        else:
            last = m.expired()
            m.evict(last)
    assert last == evicted
    assert m.live() == live
    assert set(evicted) <= m.evicted and m.evictions_total >= len(evicted)


# (state of worker 0 before, event) -> (registered?, evicted?, left?, what the registration/leave reports)
REGISTER_TABLE = [
    ("unknown", "register", (True, False, False), "new"),
    ("registered", "register", (True, False, False), "again"),
    ("evicted", "register", (True, False, False), "rejoined"),
    ("left", "register", (True, False, False), "rejoined"),
    ("unknown", "leave", (False, False, False), False),
    ("registered", "leave", (False, False, True), True),
    ("evicted", "leave", (False, True, False), False),
    ("left", "leave", (False, False, True), False),
]


def _in_state(state: str) -> Membership:
    m, clock = _members()
    m.register(1)  # another worker stays, so no "every worker had left" restart
    if state in ("registered", "evicted", "left"):
        m.register(0)
    if state == "evicted":
        m.evict([0])
    if state == "left":
        m.leave(0)
    return m


@pytest.mark.parametrize("state, event, after, report", REGISTER_TABLE)
def test_register_and_leave_table(state, event, after, report):
    m = _in_state(state)
    if event == "register":
        j = m.register(0)
        got = "rejoined" if j.rejoined else ("new" if j.new else "again")
        assert j.live_changed == j.rejoined
    else:
        got = m.leave(0)
    assert got == report
    assert (0 in m.workers, 0 in m.evicted, 0 in m.left) == after


def test_when_every_worker_left_a_registration_starts_the_next_run():
    m, _ = _members(2)
    m.register(0)
    m.register(1)
    m.leave(0)
    m.leave(1)
    assert m.live() == set() and m.leaves_total == 2
    j = m.register(1)
    assert j.live_changed and m.left == set() and m.live() == {0, 1}


def test_not_after_an_eviction():
    m, _ = _members(2)
    m.register(0)
    m.register(1)
    m.leave(0)
    m.evict([1])
    j = m.register(1)  # the evicted one back to finish: does not wait for the one that left
    assert m.live() == {1} and j.rejoined


def test_checks_name_what_is_wrong():
    m = Membership(3, 5.0)
    with pytest.raises(FailedPrecondition, match="no job yet"):
        m.check_worker_id(0)
    m.num_workers = 2
    with pytest.raises(InvalidArgument, match=r"worker_id must be in \[0, 2\), got 2"):
        m.check_worker_id(2)
    with pytest.raises(FailedPrecondition, match="not registered on shard 3"):
        m.check_registered(1)
    m.register(1)
    m.evict([1])
    with pytest.raises(FailedPrecondition, match=r"evicted from shard 3 \(its lease of 5.0s"):
        m.check_registered(1)


def test_renew_all_gives_every_registered_worker_a_fresh_lease():
    m, clock = _members()
    m.register(0)
    clock.now = 150.0
    m.renew_all()
    clock.now = 159.0
    assert m.expired() == []
    clock.now = 161.0
    assert m.expired() == [0]


def test_the_store_reads_leases_from_its_injected_clock():
    import torch

    import shardps
    from shardps.server.store import ShardStore, TensorSpec

    clock = FakeClock()
    st = ShardStore(0, 1, sync="bsp", num_workers=2, lease_s=10.0, clock=clock)
    st.path.register_tensors([TensorSpec("w", (2,), 1, shardps.optim.SGD(lr=1.0), ((0, 2),))], {("w",
                                                                                                 0): torch.zeros(2)})
    st.leases.register(0)
    st.leases.register(1)
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(2)})  # waits for worker 1 in the barrier
    clock.now = 105.0
    st.leases.touch(0)
    clock.now = 112.0
    assert st.leases.evict_expired() == [1]  # worker 1 silent since 100: the round completes without it
    assert st.job.version == 1 and st.leases.live() == {0}
