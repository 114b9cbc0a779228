"""A worker back after an eviction goes on from its newest clock on any shard; a shard that evicted it skips it to
that clock with its next push (RegisterResponse.skips). Without an eviction a gap in a worker's steps is refused, and
a restarted worker goes on from its lowest clock as before (the shards that took a step in answer it as a duplicate).
Evictions are made at an exact point (``ShardStore.evict``, what the lease reaper calls), never by waiting."""

from __future__ import annotations

import threading

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


def test_a_worker_that_rejoins_while_a_barrier_holds_its_last_push_pulls_that_round_before_pushing_again(
        make_cluster):
    """bsp, 2 workers, 2 shards. Shard 1 evicts worker 0 (at an exact point); worker 0's step 0 is taken in by shard
    0, where the barrier holds it (worker 1 has not pushed), and refused by shard 1. At its next step worker 0
    rejoins at its newest clock, 1 (shard 0's): its pull waits for shard 0's round 0
    (RegisterResponse.ready_version), so its step 1 is taken in. It used to pull at once and push step 1 while its
    step 0 still waited: refused (FAILED_PRECONDITION), and the worker stopped."""
    c = make_cluster(2, lease_s=60.0)
    params = {"a": torch.zeros(1000, requires_grad=True), "b": torch.zeros(1000, requires_grad=True)}
    failed: list[BaseException] = []

    def step() -> threading.Thread:
        for p in params.values():
            p.grad = torch.ones(1000)

        def run() -> None:
            try:
                opt.step()
            except BaseException as e:  # handed to the test's thread
                failed.append(e)
        t = threading.Thread(target=run)
        t.start()
        return t

    with shardps.connect(c.addresses, worker_id=0, num_workers=2, recovery_timeout=1.0) as c0, \
            shardps.connect(c.addresses, worker_id=1, num_workers=2) as c1:
        opt = shardps.DistributedOptimizer(list(params.items()), c0, optimizer=shardps.optim.SGD(lr=1.0), sync="bsp")
        c1.register({n: torch.zeros(1000) for n in params}, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert {len(c0.shard_map.parts_for(i)) > 0 for i in range(2)} == {True}  # a tensor on each shard
        c.stores[1].leases.evict([0])
        with pytest.raises(shardps.ShardError, match="evicted"):
            c0.push({n: torch.ones(1000) for n in params}, 0)  # held on shard 0, refused by shard 1
        joins: list[object] = []
        joining = threading.Event()
        pull = c0.pull

        def pull_of_the_join(*args, **kw):  # the rejoin's pull, told apart from the step's by its caller
            joins.append(kw.get("min_versions"))
            joining.set()
            return pull(*args, **kw)
        c0.pull = pull_of_the_join
        first = step()  # step 0 again: a duplicate on shard 0, refused by shard 1; rejoins and pulls
        assert joining.wait(30)
        assert (opt.rejoins, c0.clock, c0.ready_versions, joins) == (1, 1, [1, 0], [[1, 0]])
        c1.push({n: torch.ones(1000) for n in params}, 0)
        first.join(30)
        assert not first.is_alive() and not failed, failed
        assert c0.versions == [1, 0]
        second = step()  # step 1: a new round on shard 0; on shard 1 it skips ahead and completes round 0
        s1 = c.stores[1]
        with s1._cond:
            assert s1._cond.wait_for(lambda: s1.job.version == 1, 30)
        c1.push({n: torch.ones(1000) for n in params}, 1)
        second.join(30)
        assert not second.is_alive() and not failed, failed
        assert [st.clocks() for st in c.stores] == [{0: 2, 1: 2}] * 2
        assert [st.job.version for st in c.stores] == [2, 1]  # shard 1 took worker 0's steps 0 and 1 as one
        assert c0.versions == [2, 1]


def test_a_streamed_worker_that_rejoins_while_a_barrier_holds_its_last_push_pulls_that_round_first(make_cluster):
    """The same with streamed weights (``Stream``): the rejoin pulls nothing, the next forward's pulls ask for
    shard 0's round 0 (``weights_from``) and wait for it; the step that follows is taken in by both shards."""
    c = make_cluster(2, lease_s=60.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    ones = {n: torch.ones(s) for n, s in shapes.items()}
    with shardps.connect(c.addresses, worker_id=0, num_workers=2, recovery_timeout=1.0) as c0, \
            shardps.connect(c.addresses, worker_id=1, num_workers=2) as c1:
        opt = shardps.DistributedOptimizer(model, c0, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp",
                                           stream=shardps.Stream(1 << 20))
        c1.register({n: torch.zeros(s) for n, s in shapes.items()}, shardps.optim.SGD(lr=0.1), sync="bsp")
        assert {len(c0.shard_map.parts_for(i)) > 0 for i in range(2)} == {True}  # a tensor on each shard
        c.stores[1].leases.evict([0])
        with pytest.raises(shardps.ShardError, match="evicted"):
            c0.push(ones, 0)  # held on shard 0, refused by shard 1
        x = torch.randn(8, 16)
        model(x).sum().backward()
        opt.step()  # step 0 again: a duplicate on shard 0, refused by shard 1; rejoins
        assert (opt.rejoins, c0.clock, opt.stream.mins) == (1, 1, [1, 0])
        failed: list[BaseException] = []

        def next_step() -> None:
            try:
                model(x).sum().backward()  # its pulls wait for shard 0's round 0
                opt.step()
            except BaseException as e:  # handed to the test's thread
                failed.append(e)
        t = threading.Thread(target=next_step)
        t.start()
        c1.push(ones, 0)
        t.join(30)
        assert not t.is_alive() and not failed, failed
        assert [st.clocks()[0] for st in c.stores] == [2, 2]  # step 1 taken in by both (shard 1 skipped step 0)
