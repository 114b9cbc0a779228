"""Row tables under the job's sync mode, end to end: a model with an embedding under ssp:1, a straggler held at
an exact step; the fast worker's row pushes stay within the bound as its dense ones do (docs/sync.md)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import shardps

S = 1
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(shardps.nn.Embedding(20, 4, name="emb", optimizer=shardps.optim.SGD(lr=0.1)),
                         nn.Linear(4, 1))


@pytest.mark.parametrize("overlap", [False, True])
def test_under_ssp_the_rows_of_a_fast_worker_stay_within_the_bound_of_a_held_straggler(make_cluster, overlap):
    cluster = make_cluster(2)
    release = threading.Event()
    first = threading.Event()  # the straggler pushed its step 0: the fast worker goes past its own only then
    errors: list[BaseException] = []

    def train(k: int) -> None:
        try:
            model = _model()
            with shardps.connect(cluster.addresses, worker_id=k, num_workers=2, timeout=60) as client:
                opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1),
                                                   sync=f"ssp:{S}", overlap=overlap)
                for step in range(STEPS):
                    if k == 1 and step == 1:
                        release.wait(60)  # the straggler, held after its step 0
                    if k == 0 and step == 1:  # else it may wait for a straggler still joining (no clock yet)
                        assert first.wait(60)
                    ids = torch.tensor([step % 20, (step + 7) % 20, 3])
                    model(ids).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    if k == 1 and step == 0:
                        first.set()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    try:
        # The fast worker is held once it is S steps ahead (+1 in flight): on every shard a dense pull or a row
        # call of it waits, while the straggler has pushed its step 0 and nothing more.
        for s in cluster.stores:
            with s._cond:
                assert s._cond.wait_for(lambda s=s: s.job.waiting + s.rows.waiting > 0, 60), s.rows.tables
                clocks = {w: st + 1 for w, st in s.rows.tables["emb"].pushed.items()}
                dense = {w: c + 1 for w, c in s.job.worker_clocks.items()}
            assert clocks[1] == 1 and S <= clocks[0] - clocks[1] <= S + 1, clocks  # the rows: at most S + 1 ahead
            assert dense[1] == 1 and dense[0] - dense[1] <= S + 1, dense  # as the dense part
    finally:
        release.set()
        for th in threads:
            th.join(120)
    assert not errors, errors
    for s in cluster.stores:
        assert {w: st + 1 for w, st in s.rows.tables["emb"].pushed.items()} == {0: STEPS, 1: STEPS}


def test_a_live_switch_reaches_the_row_tables_with_the_next_push(make_cluster):
    """bsp for two steps, then `set_sync("asp")` from the operator: each table's policy follows with the workers'
    first push under the new mode, and the job goes on under asp, every push taken in once."""
    cluster = make_cluster(2)
    switched = threading.Barrier(2, timeout=60)
    modes: list[set[str]] = []

    def train(k: int) -> None:
        model = _model()
        with shardps.connect(cluster.addresses, worker_id=k, num_workers=2, timeout=60) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
            for step in range(4):
                if step == 2:
                    if k == 0:
                        client.set_sync("asp")
                        modes.append({s.rows.tables["emb"].mode[0] for s in cluster.stores})
                    switched.wait()
                model(torch.tensor([step, step + 5, 3])).sum().backward()
                opt.step()
                opt.zero_grad()

    from tests.helpers import run_workers

    run_workers(train, 2)
    assert modes == [{"bsp"}]  # the switch itself leaves the tables: the next push brings it
    for s in cluster.stores:
        t = s.rows.tables["emb"]
        # steps 0-2 in bsp rounds (a worker learns the switch from its step 2's dense answer, after that step's
        # row push), step 3's two pushes on arrival
        assert t.mode == ("asp", 2) and t.rounds == 3 and t.pushed == {0: 3, 1: 3}
        assert t.steps == 3 + 2 and t.counts["duplicates"] == 0
