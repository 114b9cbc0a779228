"""A row table's sync policy (server/rows/tables.py): the job's mode, one SyncPolicy, waits at the next call.

In process, no servers: ``RowTables`` alone, pushes and pulls from threads where one must wait, every wait
observed at its exact point (``RowTables.waiting``), never by time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from shardps.protos.optim import SGD
from shardps.protos.rows import RowTableSpec
from shardps.server.errors import DeadlineExceeded
from shardps.server.rows.tables import RowTables

KEYS = np.array([1, 2], dtype=np.uint64)


def _tables() -> RowTables:
    rows = RowTables()
    rows.register(RowTableSpec("t", 2, SGD(lr=1.0), "int64", {"kind": "zeros"}))
    return rows


def _push(rows: RowTables, worker: int, step: int, value: float, sync: str, **kw: object):
    return rows.push("t", 2, KEYS, torch.full((2, 2), value), worker=worker, step=step, num_workers=2, sync=sync,
                     **kw)


def _weights(rows: RowTables) -> torch.Tensor:
    return rows.pull("t", 2, KEYS)[0]


def _in_background(fn) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, out


def _until_waiting(rows: RowTables, n: int = 1) -> None:
    with rows.lock:
        assert rows.lock.wait_for(lambda: rows.waiting == n, 30)


def test_a_barrier_round_is_applied_once_every_worker_pushed_and_a_pull_waits_for_it():
    rows = _tables()
    first = _push(rows, 0, 0, 1.0, "bsp")
    assert (first.ready, rows.tables["t"].rounds, first.steps) == (1, 0, 0)  # taken in, held
    th, out = _in_background(lambda: rows.pull("t", 2, KEYS, min_round=first.ready, timeout=30))
    _until_waiting(rows)
    assert _push(rows, 1, 0, 3.0, "bsp").ready == 1  # the round is complete: applied, the pull answered
    th.join(30)
    assert torch.equal(out["value"][0], torch.full((2, 2), -2.0))  # 0 - (1 + 3) / 2, one step
    assert rows.tables["t"].steps == 1


def test_under_ssp_a_push_waits_until_the_slowest_worker_is_within_s_steps():
    """ssp:1: the fast worker's pushes of steps 0 and 1 are taken in at once; its push of step 2 waits until
    the straggler has pushed step 0 (2 - S = 1 step), as a dense worker's pull waits for the clock."""
    rows = _tables()
    for step in (0, 1):
        _push(rows, 0, step, 1.0, "ssp:1")
    assert rows.tables["t"].steps == 2  # applied on arrival
    th, out = _in_background(lambda: _push(rows, 0, 2, 1.0, "ssp:1", timeout=30))
    _until_waiting(rows)
    assert rows.tables["t"].pushed == {0: 1}  # step 2 not taken in while worker 1 is at clock 0
    _push(rows, 1, 0, 1.0, "ssp:1")
    th.join(30)
    assert "error" not in out and rows.tables["t"].pushed == {0: 2, 1: 0}
    # and a pull after step 2 (clock 3) with min_clock 3 - 1 waits for worker 1's step 1
    th, out = _in_background(lambda: rows.pull("t", 2, KEYS, min_clock=2, timeout=30))
    _until_waiting(rows)
    _push(rows, 1, 1, 1.0, "ssp:1")
    th.join(30)
    assert "value" in out


def test_a_wait_that_runs_out_names_what_it_waited_for():
    rows = _tables()
    _push(rows, 0, 0, 1.0, "bsp")
    with pytest.raises(DeadlineExceeded, match=r"round 1 \(at 0\).*missing \[1\]"):
        rows.pull("t", 2, KEYS, min_round=1, timeout=0.05)
    _push(rows, 0, 1, 1.0, "ssp:1")  # a switch applies the held round first (a test below); clocks: {0: 2}
    with pytest.raises(DeadlineExceeded, match=r"clock 1 \(ssp:1\); behind: \{1: 0\}"):
        rows.pull("t", 2, KEYS, min_clock=1, timeout=0.05)
    with pytest.raises(DeadlineExceeded, match=r"clock 2 \(ssp:0\); behind: \{1: 0\}"):
        _push(rows, 0, 2, 1.0, "ssp:0", timeout=0.05)
    assert rows.tables["t"].pushed == {0: 1}  # refused: nothing taken in


def test_a_live_switch_applies_the_held_round_first_and_nothing_twice():
    """bsp -> asp while worker 0's step 0 is held: the round is applied with what it holds (worker 0's alone,
    as a dense barrier's flush), then step 1 on arrival; worker 1's late step 0 under asp is applied once."""
    rows = _tables()
    _push(rows, 0, 0, 2.0, "bsp")
    answer = _push(rows, 0, 1, 4.0, "asp")
    assert answer.ready == 1 and rows.tables["t"].rounds == 1 and rows.tables["t"].steps == 2
    assert torch.equal(_weights(rows), torch.full((2, 2), -6.0))  # -2 (the flushed round), -4 (step 1)
    _push(rows, 1, 0, 1.0, "asp")
    _push(rows, 1, 0, 1.0, "asp")  # a retry: answered, not applied again
    assert torch.equal(_weights(rows), torch.full((2, 2), -7.0))
    assert rows.tables["t"].counts["duplicates"] == 1


def test_a_round_in_progress_is_in_the_snapshot_and_completes_after_a_restore():
    """A backup attached mid-round, or a restart from a checkpoint: the held pushes are restored with it."""
    rows = _tables()
    _push(rows, 0, 0, 1.0, "every:2")
    meta, tensors = rows.snapshot()
    again = RowTables()
    again.restore(meta, tensors)
    assert _push(again, 1, 0, 3.0, "every:2").ready == 1
    assert torch.equal(_weights(again), torch.full((2, 2), -2.0)) and again.tables["t"].rounds == 1


def test_an_eviction_completes_the_round_without_the_gone_worker():
    gone: set[int] = set()
    rows = RowTables(gone=lambda: gone)
    rows.register(RowTableSpec("t", 2, SGD(lr=1.0), "int64", {"kind": "zeros"}))
    _push(rows, 0, 0, 2.0, "bsp")
    th, out = _in_background(lambda: rows.pull("t", 2, KEYS, min_round=1, timeout=30))
    _until_waiting(rows)
    with rows.lock:
        gone.add(1)
        rows.live_changed()
    th.join(30)
    assert torch.equal(out["value"][0], torch.full((2, 2), -2.0))
