"""The partition harness's checker (deploy/partitioncheck.py): each rule finds what it is for, and nothing else."""

from __future__ import annotations

from shardps.deploy.partitioncheck import check

PER = 4  # coordinates a worker
PARTS = [["t0", 0, 2 * PER, 0], ["t1", 0, 2 * PER, 1]]  # two workers, two shards


def acked(version: int, epoch: int = 1, server: str = "a", duplicate: bool = False, shards=(0, 1)):
    return {"outcome": "acked", "acks": [[s, version, f"{server}{s}", epoch, duplicate] for s in shards]}


def weights(*values: list[float]) -> dict[str, list[float]]:
    flat = [v for vs in values for v in vs]
    return {"t0": list(flat), "t1": list(flat)}


def test_a_clean_run_has_no_violation_and_counts_each_outcome():
    logs = [[acked(1), acked(3), {"outcome": "dropped", "acks": []}],
            [acked(2), {"outcome": "pending", "acks": []}]]
    t = check(logs, PARTS, weights([1, 1, 1, 0], [1, 0, 0, 0]), PER)
    assert t.violations == []
    assert (t.acked, t.dropped, t.pending, t.unknown_applied, t.acks) == (6, 2, 2, 2, 6)


def test_an_acknowledged_push_missing_from_the_weights_is_lost():
    t = check([[acked(1)], []], PARTS, {"t0": [1, 0, 0, 0] + [0] * PER, "t1": [0] * 2 * PER}, PER)
    assert t.lost == 1 and t.violations == ["lost, acknowledged: worker 0's push 0 on shard 1 (t1[0] = 0)"]


def test_a_push_applied_twice_or_never_made_is_a_violation():
    t = check([[acked(1)], []], PARTS, weights([2, 0, 0, 0], [0, 0, 1, 0]), PER)
    assert t.doubled == 2
    assert sum(v.startswith("never made, yet applied") for v in t.violations) == 2
    t = check([[{"outcome": "dropped", "acks": []}], []], PARTS, weights([0.5, 0, 0, 0], [0] * PER), PER)
    assert all(v.startswith("not a whole number") for v in t.violations) and len(t.violations) == 2


def test_one_version_acknowledged_by_two_servers_is_split():
    logs = [[acked(5, server="a")], [acked(5, server="b")]]
    t = check(logs, PARTS, weights([1, 0, 0, 0], [1, 0, 0, 0]), PER)
    assert t.split == 2 and "version 5 of shard 0 acknowledged 2 times, by a0, b0" in t.violations


def test_a_duplicate_acknowledgement_names_no_version_of_its_own():
    logs = [[acked(5), acked(6)], [acked(6, duplicate=True)]]  # a push sent again, answered at the version then
    t = check(logs, PARTS, weights([1, 1, 0, 0], [1, 0, 0, 0]), PER)
    assert t.violations == [] and t.duplicates == 2


def test_an_epoch_that_goes_down_is_a_violation():
    logs = [[acked(1, epoch=2), acked(2, epoch=1)], []]
    t = check(logs, PARTS, weights([1, 1, 0, 0], [0] * PER), PER)
    down = [v for v in t.violations if v.startswith("epoch went down")]
    assert len(down) == 4  # in worker 0's order and in each shard's version order, on both shards
