"""Sync policies as tables: no network, no store."""

import pytest
import torch

from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import FailedPrecondition
from shardps.server.sync import AsyncPolicy, BarrierPolicy, Contribution, make_policy, staleness


def g(v):
    return {("w", 0): torch.tensor([float(v)])}


# worker offered -> (updates due, mean applied, workers held afterwards)
BSP_TABLE = [
    (0, 0, None, [0]),
    (2, 0, None, [0, 2]),
    (1, 1, (1 + 3 + 2) / 3, []),  # all three in: one update, the mean of their values (worker id + 1)
    (1, 0, None, [1]),            # the next round starts
]


def test_bsp_table():
    p = BarrierPolicy(3)
    step = {0: 0, 1: 0, 2: 0}
    for w, n_updates, mean, held in BSP_TABLE:
        updates = p.offer(Contribution(w, step[w], step[w]), g(w + 1))
        step[w] += 1
        assert len(updates) == n_updates, w
        if n_updates:
            assert updates[0].grads[("w", 0)].item() == pytest.approx(mean)
            assert sorted(c.worker_id for c in updates[0].contributions) == [0, 1, 2]
        assert p.pending_workers == held
    assert p.rounds == 1 and p.holds(1) and not p.holds(0)


def test_bsp_refuses_a_second_gradient_in_one_round_and_changes_nothing():
    p = BarrierPolicy(2)
    p.offer(Contribution(0, 0, 0), g(1))
    with pytest.raises(FailedPrecondition, match="worker 0 pushed step 1 while its step 0 still waits"):
        p.offer(Contribution(0, 1, 0), g(5))
    assert p.pending_workers == [0]
    (u,) = p.offer(Contribution(1, 0, 0), g(3))
    assert u.grads[("w", 0)].item() == 2.0


def test_bsp_rounds_count_arrivals_not_step_numbers():
    # After a switch from asp, workers' clocks differ: the barrier still pairs their next gradients.
    p = BarrierPolicy(2)
    assert p.offer(Contribution(0, 57, 100), g(1)) == []
    (u,) = p.offer(Contribution(1, 31, 99), g(3))
    assert u.grads[("w", 0)].item() == 2.0


def test_bsp_mean_is_over_workers_that_sent_each_part():
    p = BarrierPolicy(2)
    p.offer(Contribution(0, 0, 0), {("a", 0): torch.tensor([2.0]), ("b", 0): torch.tensor([4.0])})
    (u,) = p.offer(Contribution(1, 0, 0), {("a", 0): torch.tensor([4.0])})
    assert u.grads[("a", 0)].item() == 3.0 and u.grads[("b", 0)].item() == 4.0


def test_flush_hands_over_a_partial_round_once():
    p = BarrierPolicy(3)
    p.offer(Contribution(0, 0, 0), g(2))
    p.offer(Contribution(1, 0, 0), g(4))
    (u,) = p.flush()
    assert u.grads[("w", 0)].item() == 3.0 and [c.worker_id for c in u.contributions] == [0, 1]
    assert p.flush() == [] and p.pending_workers == []
    assert AsyncPolicy().flush() == []


def test_a_late_gradient_joins_the_round_beside_the_workers_own_and_nobody_waits_for_it():
    # Worker 1's step straddled a switch to bsp: its gradient came from asp (late). It is summed into the round
    # (mean over three), does not stand for worker 1's own gradient of the round, and is not waited for.
    p = BarrierPolicy(2)
    assert p.offer(Contribution(1, 7, 0, late=True), g(6)) == []
    assert p.pending_workers == [] and not p.holds(1) and not p.quiescent()
    assert p.offer(Contribution(0, 3, 0), g(2)) == []
    assert p.pending_workers == [0] and p.holds(0)
    (u,) = p.offer(Contribution(1, 8, 0), g(4))  # worker 1's own: the round is complete
    assert u.grads[("w", 0)].item() == 4.0  # (6 + 2 + 4) / 3
    assert [(c.worker_id, c.step, c.late) for c in u.contributions] == [(1, 7, True), (0, 3, False), (1, 8, False)]
    assert p.rounds == 1 and p.quiescent()


def test_a_late_gradient_under_asp_is_applied_on_arrival():
    (u,) = AsyncPolicy().offer(Contribution(0, 4, 1, late=True), g(3))
    assert u.grads[("w", 0)].item() == 3.0 and u.contributions[0].late


def test_bsp_waiting_on_names_missing_workers():
    p = BarrierPolicy(3)
    p.offer(Contribution(1, 0, 0), g(1))
    assert p.waiting_on() == "round 0 has gradients from workers [1], missing [0, 2]"


def test_asp_applies_each_gradient_on_arrival():
    p = AsyncPolicy()
    assert len(p.offer(Contribution(0, 0, 0), g(1))) == 1
    assert len(p.offer(Contribution(1, 0, 0), g(1))) == 1
    assert not p.holds(0)


@pytest.mark.parametrize("text, cls", [("every:4", BarrierPolicy), ("bsp", BarrierPolicy), ("asp", AsyncPolicy),
                                       ("ssp:3", AsyncPolicy)])
def test_make_policy(text, cls):
    assert isinstance(make_policy(SyncSpec.parse(text), 2), cls)


def test_staleness():
    assert staleness(5, [Contribution(0, 0, 5), Contribution(1, 0, 3)]) == [0, 2]


@pytest.mark.parametrize("text, accumulation, clocks", [
    ("bsp", 1, [0, 0, 0]),
    ("asp", 1, [0, 0, 0]),
    ("every:4", 4, [0, 0, 0]),
    ("ssp:0", 1, [0, 1, 5]),
    ("ssp:2", 1, [0, 0, 3]),
])
def test_what_a_worker_asks_of_the_spec(text, accumulation, clocks):
    """The worker's side of a mode: local steps summed before a push, and the slowest clock waited for
    at clocks 0, 1 and 5."""
    spec = SyncSpec.parse(text)
    assert spec.accumulation == accumulation
    assert [spec.min_clock(c) for c in (0, 1, 5)] == clocks
