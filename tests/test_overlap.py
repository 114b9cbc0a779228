"""Overlap (push during backward, pull during the next forward) changes no weight: exactness against the plain path.

Two workers: a shard's bsp sum of two gradients does not depend on their
arrival order (float addition is commutative), so the weights must be
bitwise equal with and without overlap.
"""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch
from torch import nn

import shardps
from tests.helpers import run_workers

STEPS = 4
BATCH = 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 3))


def data(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + step)
    return torch.randn(BATCH, 10, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def train(addresses, workers: int, sync: str, steps: int, *, backwards: int = 1, **opt_kw):
    """Each worker's weights after ``steps`` calls of step() (``backwards`` backward passes each)."""
    base = make_model()

    def worker(k: int) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(base)
        client = shardps.connect(addresses, worker_id=k, num_workers=workers, part_bytes=1024, chunk_bytes=1024)
        try:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync,
                                               **opt_kw)
            for step in range(steps):
                for b in range(backwards):
                    x, y = data(step * backwards + b, k)
                    nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            out = {n: p.detach().clone() for n, p in model.named_parameters()}
            if opt.overlap is not None:
                out["streamed"] = torch.tensor(opt.overlap.streamed_steps)
                out["whole"] = torch.tensor(opt.overlap.whole_steps)
            return out
        finally:
            client.close()

    return run_workers(worker, workers)


def _weights(result):
    return {n: w for n, w in result.items() if n not in ("streamed", "whole")}


@pytest.mark.parametrize("sync, workers", [("bsp", 2), ("asp", 1), ("every:2", 2), ("ssp:1", 1)])
def test_overlap_equals_the_plain_path(make_cluster, sync, workers):
    plain = train(make_cluster(2).addresses, workers, sync, STEPS)
    # Buckets of ~3 KB: the 64x10 and 32x64 matrices each go up alone, while backward runs.
    over = train(make_cluster(2).addresses, workers, sync, STEPS, overlap=True, bucket_bytes=3000)
    for k in range(workers):
        for n, w in _weights(plain[k]).items():
            assert torch.equal(over[k][n], w), f"worker {k}, {n}: overlap changed the weights"
        pushes = STEPS // (2 if sync == "every:2" else 1)
        assert int(over[k]["streamed"]) == pushes and int(over[k]["whole"]) == 0


def test_two_backwards_in_a_step_push_whole_and_stay_exact(make_cluster):
    """Gradient accumulation by hand (backward twice before step()): overlap steps aside, the result is
    the plain path's."""
    plain = train(make_cluster(2).addresses, 2, "bsp", 3, backwards=2)
    over = train(make_cluster(2).addresses, 2, "bsp", 3, backwards=2, overlap=True, bucket_bytes=3000)
    for k in range(2):
        for n, w in _weights(plain[k]).items():
            assert torch.equal(over[k][n], w), f"worker {k}, {n}"
        assert int(over[k]["whole"]) == 3


def test_a_forward_waits_for_the_weights_of_its_step(cluster2):
    """bsp: worker 0's step() returns before worker 1 has pushed; its next forward must compute with the
    weights of the completed step, not those it had. Worker 1 pushes only once worker 0's second forward has
    begun (a pre-hook registered before the optimizer's, counting forwards: set by the first, it let worker 1
    push before worker 0's own push, whose answer then brought the weights, and the test could not fail), so
    a forward that did not wait would see the old weights."""
    base = make_model()
    entered = threading.Event()
    seen: dict[str, torch.Tensor] = {}
    finals: dict[int, dict[str, torch.Tensor]] = {}

    def worker(k: int) -> None:
        model = copy.deepcopy(base)
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=2, part_bytes=1024)
        try:
            if k == 0:
                forwards = itertools.count(1)

                def second_forward(m: nn.Module, a: tuple) -> None:  # (a pre-hook's value would replace the input)
                    if next(forwards) == 2:
                        entered.set()

                model.register_forward_pre_hook(second_forward)
                first = model[0]
                first.register_forward_hook(lambda m, a, out: seen.update(w=m.weight.detach().clone()))
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.5), sync="bsp",
                                               overlap=k == 0)
            x, y = data(0, k)
            nn.functional.cross_entropy(model(x), y).backward()
            if k == 1:
                assert entered.wait(60), "worker 0 never began its second forward"
            opt.step()
            opt.zero_grad()
            if k == 0:
                before = model[0].weight.detach().clone()
                seen["before"] = before
                model(x)  # waits in the optimizer's pre-hook for step 1's weights
            opt.synchronize()
            finals[k] = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            client.close()

    entered.clear()
    run_workers(worker, 2)
    # What the second forward of worker 0 computed with: the weights after step 1 (as worker 1 has them).
    assert torch.equal(seen["w"], finals[1]["0.weight"])
    assert not torch.equal(seen["w"], base[0].weight.detach())
    assert torch.equal(finals[0]["0.weight"], finals[1]["0.weight"])


def test_close_cancels_the_pull_started_for_a_step_that_never_comes(cluster2):
    """bsp, worker 1 registered but never pushing: worker 0's step() starts the pull of a version that will
    not come. close() cancels it (CANCELLED) instead of waiting for its deadline (then: DEADLINE_EXCEEDED)."""
    other = shardps.connect(cluster2.addresses, worker_id=1, num_workers=2, timeout=120)
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=2, timeout=120)
    try:
        model = make_model()
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.5), sync="bsp",
                                           overlap=True)
        x, y = data(0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        pull = opt.overlap.pull
        assert pull is not None and not pull.done()
        client.close()
        assert pull.done()
        with pytest.raises(shardps.ShardError) as e:
            pull.result()
        assert e.value.code.name == "CANCELLED", e.value
    finally:
        client.close()
        other.close()


def test_found_inf_in_a_late_bucket_skips_the_step_everywhere(cluster2):
    """Loss scaling: an inf in the first layer's gradient (the last bucket to go up) still skips the step
    on every shard: the flag goes in the stream's last message."""
    model = make_model()
    client = shardps.connect(cluster2.addresses, part_bytes=1024)
    try:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.5), sync="bsp",
                                           loss_scaling=True, overlap=True, bucket_bytes=3000)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        scale = opt.loss_scale
        x, y = data(0, 0)
        x[0, 0] = float("inf")  # the first layer's weight gradient gets a nan/inf
        opt.scale(nn.functional.cross_entropy(model(x), y)).backward()
        assert not torch.isfinite(model[0].weight.grad).all()
        opt.step()
        opt.synchronize()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[n]), f"{n} changed in a skipped step"
        assert opt.loss_scale == scale / 2
        assert [s["skipped_steps_total"] for s in client.stats()] == [1, 1]
    finally:
        client.close()


def test_weights_down_in_bf16(cluster2):
    """pull_dtype=bf16: the parameters hold the fp32 masters rounded to bf16; the masters stay fp32."""
    model = make_model()
    client = shardps.connect(cluster2.addresses, part_bytes=1024)
    try:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp",
                                           pull_dtype=torch.bfloat16)
        x, y = data(0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        masters = client.pull(dtype=torch.float32)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), masters[n].to(torch.bfloat16).float()), n
            assert not torch.equal(masters[n].to(torch.bfloat16).float(), masters[n]), n
    finally:
        client.close()


def test_overlap_needs_the_model(cluster2):
    model = make_model()
    client = shardps.connect(cluster2.addresses)
    try:
        with pytest.raises(ValueError, match="needs the model"):
            shardps.DistributedOptimizer(model.named_parameters(), client, overlap=True)
        with pytest.raises(ValueError, match="pull_dtype"):
            shardps.DistributedOptimizer(model, client, pull_dtype=torch.int8)
    finally:
        client.close()


def test_calls_get_through_while_a_push_stream_is_open(cluster2):
    """An open bucketed push holds a transport thread per shard for a whole backward (overlap); the client's
    other calls over the shards (stats, a pull) must still get through meanwhile, not wait for the step's end."""
    model = make_model()
    client = shardps.connect(cluster2.addresses, part_bytes=1024)
    try:
        shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1))
        stream = client.push_bucketed(client.clock)
        pulling = client.pull_async()  # a pull in flight holds one more thread per shard
        pulling.result()
        done = threading.Event()
        caller = threading.Thread(target=lambda: (client.stats(), client.pull_async().result(), done.set()))
        caller.start()
        caller.join(30)
        assert done.is_set(), "a call waited behind the open bucketed pushes"
        stream.add({n: torch.zeros_like(p) for n, p in model.named_parameters()})
        assert all(r.applied for r in stream.finish())
    finally:
        client.close()
