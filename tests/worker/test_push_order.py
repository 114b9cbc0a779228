"""The order of a step's pushes and their window (worker/datapath/pushorder.py), and each shard's pull begun as that
shard answers: over real gRPC servers, exact against pushing every shard at once."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import shardps
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.datapath.pushorder import host_of, in_order, push_order
from tests.helpers import run_workers


def test_host_of():
    assert host_of("10.0.0.1:7000") == "10.0.0.1"
    assert host_of("[::1]:7000") == "[::1]"
    assert host_of("server-3") == "server-3"


def test_push_order_deals_the_shards_round_robin_over_the_hosts_starting_at_the_workers_host():
    # 2 hosts, 3 shards each, in shard order a0 a1 a2 b0 b1 b2
    addresses = ["a:1", "a:2", "a:3", "b:1", "b:2", "b:3"]
    assert push_order(addresses, 0) == [0, 3, 1, 4, 2, 5]
    assert push_order(addresses, 1) == [3, 0, 4, 1, 5, 2]
    assert push_order(addresses, 2) == push_order(addresses, 0)
    # every order is a permutation of the shards
    for w in range(5):
        assert sorted(push_order(addresses, w)) == list(range(6))


def test_push_order_spreads_the_workers_over_the_hosts_at_every_position():
    hosts = [f"h{h}:{p}" for h in range(4) for p in range(3)]  # 4 hosts x 3 shards
    orders = [push_order(hosts, w) for w in range(4)]
    for position in range(12):
        assert len({host_of(hosts[o[position]]) for o in orders}) == 4  # 4 workers on 4 different hosts


def test_push_order_with_uneven_hosts():
    assert push_order(["a:1", "b:1", "b:2"], 0) == [0, 1, 2]
    assert push_order(["a:1", "b:1", "b:2"], 1) == [1, 0, 2]
    assert push_order([], 3) == []


def test_in_order_starts_in_order_at_most_window_at_once_and_runs_then_before_the_next_starts():
    lock = threading.Lock()
    running = 0
    most = 0
    log: list[str] = []

    def fn(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            log.append(f"start {i}")
        with lock:
            running -= 1
        return i * 10

    with ThreadPoolExecutor(4) as pool:
        got = in_order(pool, fn, [2, 0, 1], window=1, wait_s=10,
                       then=lambda i, v: log.append(f"then {i} {v}"))
        assert got == {2: 20, 0: 0, 1: 10}
        assert log == ["start 2", "then 2 20", "start 0", "then 0 0", "start 1", "then 1 10"]
        assert most == 1
        with pytest.raises(ValueError, match="window must be >= 1"):
            in_order(pool, fn, [0], window=0, wait_s=1)


def test_in_order_runs_every_call_when_one_fails_then_raises_the_failure():
    ran: list[int] = []

    def fn(i: int) -> int:
        ran.append(i)
        if i == 0:
            raise RuntimeError("shard 0 failed")
        return i

    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="shard 0 failed"):
        in_order(pool, fn, [0, 1, 2], window=1, wait_s=10)
    assert ran == [0, 1, 2]


STEPS = 6
WORKERS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3))


def _data(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(addresses: list[str], window: int | None, sync: str) -> list[dict[str, torch.Tensor]]:
    base = _model()

    def worker(k: int) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(base)
        client = shardps.connect(addresses, worker_id=k, num_workers=WORKERS, part_bytes=512)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync,
                                           push_window=window)
        for step in range(STEPS):
            x, y = _data(step, k)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        client.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    return run_workers(worker, WORKERS)


@pytest.mark.parametrize("sync", ["bsp", "every:2"])
def test_a_window_of_one_gives_the_same_weights_as_every_shard_at_once(make_cluster, sync):
    at_once = make_cluster(4)
    expected = _train(at_once.addresses, None, sync)
    windowed = make_cluster(4)
    got = _train(windowed.addresses, 1, sync)
    for k in range(WORKERS):
        for name, value in expected[0].items():
            assert torch.equal(got[k][name], value), (k, name)
    assert all(st.job.version == windowed.stores[0].job.version for st in windowed.stores)
    assert windowed.stores[0].job.version == at_once.stores[0].job.version > 0


def test_each_shards_pull_begins_as_it_answers_before_the_next_push_goes(make_cluster, monkeypatch):
    """Window 1: push s, then the pull of s begun, then the next push: the pulls overlap later pushes."""
    cluster = make_cluster(3)
    log: list[tuple[str, int]] = []
    begin = PullInFlight.begin

    def logged_begin(self, shard, min_version, answered=()):
        log.append(("pull", shard))
        return begin(self, shard, min_version, answered)

    monkeypatch.setattr(PullInFlight, "begin", logged_begin)
    model = _model()
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=512)
    opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp",
                                       push_window=1)
    push = client.transport.push

    def logged_push(shard, requests, **kw):
        log.append(("push", shard))
        return push(shard, requests, **kw)

    monkeypatch.setattr(client.transport, "push", logged_push)
    for s, path in enumerate(client.paths):  # a frame that waits for nothing (the data connection's)
        if hasattr(path, "push_soon"):
            def logged_soon(*args, real=path.push_soon, s=s, **kw):
                log.append(("push", s))
                return real(*args, **kw)
            path.push_soon = logged_soon
    x, y = _data(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    order = push_order(client.transport.addresses, 0)
    assert log == [e for s in order for e in (("push", s), ("pull", s))]
    assert [st.job.version for st in cluster.stores] == [1, 1, 1]
    client.close()


def test_under_a_push_window_no_push_is_answered_with_the_weights(make_cluster):
    """Without a window a small model's shards answer the push with their weights (one call a step); under
    ``push_window`` none does: a push that completes a bsp round and came back with megabytes of weights
    held its place in the window meanwhile, so on a slow link the uplink idled and the worker that came
    last in one step came last in the next (docs/history/performance-log.md). Its pulls bring the same weights."""
    got = {}
    for window in (None, 1):
        cluster = make_cluster(2)
        model = _model()
        with shardps.connect(cluster.addresses, worker_id=0, num_workers=1) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="asp",
                                               push_window=window)
            x, y = _data(0, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            got[window] = ([bool(r.pulled) for r in opt.last_push], copy.deepcopy(model.state_dict()))
    assert all(got[None][0]) and not any(got[1][0])
    for k, v in got[None][1].items():
        assert torch.equal(v, got[1][1][k]), k


def test_push_window_must_be_positive(cluster2):
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1)
    with pytest.raises(ValueError, match="push_window must be >= 1"):
        shardps.DistributedOptimizer(_model(), client, push_window=0)
    client.close()
