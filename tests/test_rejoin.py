"""A worker back after an eviction goes on from its newest clock on any shard; a shard that evicted it skips it to
that clock with its next push (RegisterResponse.skips). Without an eviction a gap in a worker's steps is refused, and
a restarted worker goes on from its lowest clock as before (the shards that took a step in answer it as a duplicate).
Evictions are made at an exact point (``ShardStore.evict``, what the lease reaper calls), never by waiting."""

from __future__ import annotations

import grpc
import pytest
import torch

import shardps

pytestmark = pytest.mark.cluster


def grads() -> dict[str, torch.Tensor]:
    return {"a": torch.ones(1000), "b": torch.ones(1000)}


def test_a_worker_evicted_on_one_shard_rejoins_at_its_newest_clock_and_that_shard_skips_it_there(make_cluster):
    c = make_cluster(2)
    with shardps.connect(c.addresses, worker_id=0, num_workers=1, recovery_timeout=1.0) as client:
        client.register({"a": torch.zeros(1000), "b": torch.zeros(1000)}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert {len(client.shard_map.parts_for(i)) > 0 for i in range(2)} == {True}  # a tensor on each shard
        for step in range(3):
            client.push(grads(), step)
        c.stores[1].leases.evict([0])  # shard 1 lost the worker (a partition, a lease run out); shard 0 did not
        with pytest.raises(shardps.ShardError, match="evicted") as e:
            client.push(grads(), 3)  # taken in by shard 0 (it moves on), refused by shard 1
        assert e.value.shard == 1
        assert [st.clocks().get(0) for st in c.stores] == [4, None]  # steps pushed; shard 1 lists live workers
        client.register({"a": torch.zeros(1000), "b": torch.zeros(1000)}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert client.clock == 4  # the newest: shard 0's
        client.push(grads(), client.clock)
        assert [st.clocks().get(0) for st in c.stores] == [5, 5]  # shard 1 skipped step 3
        with pytest.raises(shardps.ShardError) as gap:
            client.push(grads(), 6)  # once skipped, steps go up by one again
        assert gap.value.code == grpc.StatusCode.FAILED_PRECONDITION and "steps go up by one" in gap.value.details


def test_without_an_eviction_a_restarted_worker_goes_on_from_its_lowest_clock(make_cluster):
    c = make_cluster(2)
    with shardps.connect(c.addresses, worker_id=0, num_workers=1) as client:
        client.register({"a": torch.zeros(1000), "b": torch.zeros(1000)}, shardps.optim.SGD(lr=1.0), sync="asp")
        for step in range(2):
            client.push(grads(), step)
    with shardps.connect(c.addresses, worker_id=0, num_workers=1) as again:
        again.register({"a": torch.zeros(1000), "b": torch.zeros(1000)}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert again.clock == 2


def test_a_shard_that_skips_a_worker_keeps_it_across_a_snapshot(make_cluster):
    """A backup synced (or a shard restored) between the rejoin and the worker's next push skips it too."""
    c = make_cluster(1)
    with shardps.connect(c.addresses, worker_id=0, num_workers=1, recovery_timeout=1.0) as client:
        client.register({"a": torch.zeros(1000)}, shardps.optim.SGD(lr=1.0), sync="asp")
        client.push({"a": torch.ones(1000)}, 0)
        store = c.stores[0]
        store.leases.evict([0])
        client.register({"a": torch.zeros(1000)}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert store.leases.membership.skips == {0}
        version, meta, tensors = store.snapshot()
        store.leases.membership.skips.clear()
        store.restore(version, meta, tensors)
        assert store.leases.membership.skips == {0}
        client.push({"a": torch.ones(1000)}, 3)  # skipped ahead from step 0
        assert store.clocks()[0] == 4 and store.leases.membership.skips == set()
