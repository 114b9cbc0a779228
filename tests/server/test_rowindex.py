"""The row tables' key -> slot index (server/rows/index.py) against a dict, through inserts, removals, moves and
rebuilds, with keys chosen to collide."""

from __future__ import annotations

import numpy as np

from shardps.protos.rows import mix64
from shardps.server.rows.index import DictIndex, KeyIndex


def test_the_index_answers_as_a_dict_through_growth_removal_and_collisions():
    rng = np.random.default_rng(0)
    index, ref = KeyIndex(), DictIndex()
    # Keys whose homes collide in a small table: the same low bits of mix64.
    pool = np.arange(200_000, dtype=np.uint64)
    crowded = pool[(mix64(pool) & np.uint64(1023)) < 4][:300]
    edges = np.array([0, 2**64 - 1, 2**63, 1], dtype=np.uint64)
    held: list[int] = []
    next_slot = 0
    for round_ in range(40):
        fresh = np.unique(np.concatenate([rng.integers(0, 2**63, 500, dtype=np.int64).view(np.uint64),
                                          crowded[round_ * 7:(round_ + 1) * 7], edges if round_ == 3 else []]))
        fresh = fresh[ref.find(fresh) < 0]
        slots = np.arange(next_slot, next_slot + len(fresh), dtype=np.int64)
        next_slot += len(fresh)
        index.insert(fresh, slots)
        ref.insert(fresh, slots)
        held += fresh.tolist()
        if round_ % 3 == 2:  # remove some, move some (as expiry does)
            all_held = np.array(held, dtype=np.uint64)
            gone = all_held[rng.choice(len(held), len(held) // 4, replace=False)]
            index.remove(gone)
            ref.remove(gone)
            held = sorted(set(held) - set(gone.tolist()))
            moved = np.array(held[:50], dtype=np.uint64)
            to = np.arange(10**6, 10**6 + 50, dtype=np.int64)
            index.move(moved, to)
            ref.move(moved, to)
        probe = np.concatenate([np.array(held, dtype=np.uint64), rng.integers(0, 2**63, 300, dtype=np.int64)
                                .view(np.uint64), crowded, edges])
        assert np.array_equal(index.find(probe), ref.find(probe)), round_
        assert index.live == ref.live == len(held)
    assert 5 * index.used <= 3 * index.capacity
