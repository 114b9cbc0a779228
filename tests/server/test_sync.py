"""Sync policies as tables: no network, no store."""

import pytest
import torch

from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import FailedPrecondition
from shardps.server.sync import AsyncPolicy, BarrierPolicy, Contribution, make_policy, staleness


def g(v):
    return {("w", 0): torch.tensor([float(v)])}


# (worker, step) offered in order -> (duplicate, updates due, mean applied if any)
BSP_TABLE = [
    ((0, 0), (False, 0, None)),
    ((0, 0), (True, 0, None)),   # retry of a held gradient: acknowledged, not counted twice
    ((2, 0), (False, 0, None)),
    ((1, 0), (False, 1, 2.0)),   # all three in: one update, the mean of 1, 3 and 2
    ((1, 0), (True, 0, None)),   # step 0 already applied
    ((1, 1), (False, 0, None)),
]


def test_bsp_table():
    p = BarrierPolicy(3)
    for (w, step), (dup, n_updates, _) in BSP_TABLE:
        o = p.offer(Contribution(w, step, step), g(w + 1))
        assert o.duplicate == dup, (w, step)
        assert len(o.updates) == n_updates, (w, step)
        if n_updates:
            u = o.updates[0]
            assert u.grads[("w", 0)].item() == pytest.approx((1 + 3 + 2) / 3)
            assert sorted(c.worker_id for c in u.contributions) == [0, 1, 2]
    assert p.next_step == 1 and p.pending_workers == [1]


def test_bsp_refuses_a_step_from_the_future_and_changes_nothing():
    p = BarrierPolicy(2)
    p.offer(Contribution(0, 0, 0), g(1))
    with pytest.raises(FailedPrecondition, match="worker 1 pushed step 3, but the barrier is at step 0"):
        p.offer(Contribution(1, 3, 0), g(5))
    assert p.pending_workers == [0]
    o = p.offer(Contribution(1, 0, 0), g(3))
    assert o.updates[0].grads[("w", 0)].item() == 2.0


def test_bsp_mean_is_over_workers_that_sent_each_part():
    p = BarrierPolicy(2)
    p.offer(Contribution(0, 0, 0), {("a", 0): torch.tensor([2.0]), ("b", 0): torch.tensor([4.0])})
    o = p.offer(Contribution(1, 0, 0), {("a", 0): torch.tensor([4.0])})
    grads = o.updates[0].grads
    assert grads[("a", 0)].item() == 3.0 and grads[("b", 0)].item() == 4.0


def test_bsp_waiting_on_names_missing_workers():
    p = BarrierPolicy(3)
    p.offer(Contribution(1, 0, 0), g(1))
    assert p.waiting_on() == "step 0 has gradients from workers [1], missing [0, 2]"


def test_asp_applies_each_gradient_on_arrival_and_drops_retries():
    p = AsyncPolicy()
    assert len(p.offer(Contribution(0, 0, 0), g(1)).updates) == 1
    assert len(p.offer(Contribution(1, 0, 0), g(1)).updates) == 1
    assert p.offer(Contribution(0, 0, 0), g(1)).duplicate
    assert len(p.offer(Contribution(0, 1, 1), g(1)).updates) == 1


def test_make_policy_and_staleness():
    assert isinstance(make_policy(SyncSpec.parse("every:4"), 2), BarrierPolicy)
    assert isinstance(make_policy(SyncSpec.parse("asp"), 2), AsyncPolicy)
    assert staleness(5, [Contribution(0, 0, 5), Contribution(1, 0, 3)]) == [0, 2]
