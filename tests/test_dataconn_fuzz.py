"""The data port under damaged frames (shardps/testing/fuzz/gen_frames.py): every one refused, nothing applied.

A seeded campaign against a live two-shard server: each case on a fresh
connection after a valid hello, the writing side ended after it (what the
server does then never depends on timing). After every case: the answers
are refusals (never OK), the shards' state is as before, and the port still
serves (a later case's hello is acknowledged). Every defect kind is drawn at
least once; a failing case names its seed and number.
"""

from __future__ import annotations

import random

import pytest
import torch

import shardps
from shardps.testing.fuzz.gen_frames import DEFECTS, Shard, judge_answers, make_case, send_case

CASES = 240


@pytest.fixture
def served(make_cluster):
    cluster = make_cluster(2)
    client = shardps.connect(cluster.addresses, shm=False)
    client.register({"w": torch.randn(6, 8), "b": torch.randn(40)}, shardps.optim.SGD(lr=0.5), sync="bsp")
    conn = client.paths[0].conn
    host, port = conn.where.rsplit(":", 1)
    shards = [Shard(p.route, name, tuple(client.layouts[name].shape))
              for p in client.paths for name in client.layouts
              if any(q.name == name for q in client.shard_map.parts_for(p.shard))]
    yield cluster, (host, int(port), conn.token, conn.worker_id), shards
    client.close()


@pytest.mark.parametrize("seed", [20261204, 7])
def test_damaged_frames_are_refused_and_change_nothing(served, seed):
    cluster, (host, port, token, worker_id), shards = served
    rng = random.Random(seed)
    before = [s.state_hash() for s in cluster.stores]
    pushes = [s.job.pushes_total for s in cluster.stores]
    seen = set()
    for i in range(CASES):
        defect = DEFECTS[i] if i < len(DEFECTS) else None  # every kind once, then drawn
        case = make_case(rng, rng.choice(shards), worker_id, defect)
        seen.add(case.defect)
        answers = send_case(host, port, token, worker_id, case)
        broke = judge_answers(case, answers)
        assert not broke, f"seed {seed}, case {i}: {broke}"
        assert [s.state_hash() for s in cluster.stores] == before, f"seed {seed}, case {i} ({case.defect})"
        assert [s.job.pushes_total for s in cluster.stores] == pushes, f"seed {seed}, case {i} ({case.defect})"
    assert seen == set(DEFECTS)
