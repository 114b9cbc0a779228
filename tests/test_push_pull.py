"""A small model's step in one call: a Push that asks (``pull_after``) is answered with the weights too.

The answer is what the Pull would have got (the same version, the same
bytes); it comes only when the weights are ready at once and small, so a
Push never waits for it; otherwise, and when the sync mode moved between
the push and the pull, the worker pulls as before.
"""

from __future__ import annotations

import copy
import threading

import grpc
import pytest
import torch
from torch import nn

import shardps
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.frames import FrameStub
from tests.helpers import run_workers

STEPS = 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(step: int, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


class PullCounter:
    """Counts the Pulls a client makes: its transport's (gRPC, or a call a path makes) and the frames its paths
    send that wait for nothing (``pull_soon``: a data connection's, shared memory's calls on it)."""

    def __init__(self, client: shardps.PSClient) -> None:
        self.calls = 0
        self._lock = threading.Lock()

        def counted(real):
            def pull(*args, **kw):
                with self._lock:
                    self.calls += 1
                return real(*args, **kw)
            return pull

        client.transport.pull = counted(client.transport.pull)  # type: ignore[method-assign]
        for path in client.paths:
            if hasattr(path, "pull_soon"):
                path.pull_soon = counted(path.pull_soon)


def test_one_asp_worker_steps_in_one_call_each_and_trains_as_torch(cluster2):
    reference = make_model()
    topt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    model = copy.deepcopy(reference)
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=256)
    try:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="asp")
        pulls = PullCounter(client)
        for step in range(STEPS):
            x, y = data(step)
            nn.functional.cross_entropy(reference(x), y).backward()
            topt.step()
            topt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert all(len(r.pulled) >= 1 for r in opt.last_push)  # both shards answered with their weights
        assert pulls.calls == 0  # not one Pull: every step was one Push per shard
        assert client.versions == [STEPS, STEPS]
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    finally:
        client.close()


@pytest.mark.fault
def test_under_bsp_only_the_push_that_completes_the_barrier_is_answered(cluster2):
    base = make_model()

    def worker(k: int) -> tuple[int, int, dict[str, torch.Tensor]]:
        model = copy.deepcopy(base)
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=2, part_bytes=256)
        try:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
            pulls = PullCounter(client)
            answered = 0
            for step in range(STEPS):
                x, y = data(step, k)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                answered += sum(1 for r in opt.last_push if r.pulled)
            return pulls.calls, answered, {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            client.close()

    results = run_workers(worker, 2)
    # Per step and shard, the push that completes the barrier is answered at once; the other one was held:
    # its worker pulls, waiting for the barrier as before (or is answered too, when the barrier completed
    # while its Push was still being answered). Each worker gets each shard's weights once per step.
    answered, pulled = sum(a for _, a, _ in results), sum(p for p, _, _ in results)
    assert answered + pulled == 2 * 2 * STEPS and answered >= 2 * STEPS
    for name, w in results[0][2].items():
        assert torch.equal(w, results[1][2][name]), name  # both workers hold the same weights


def test_answered_weights_are_written_in_the_callers_thread_before_pull_async_returns(cluster2):
    """No shard to call: nothing is handed to the client's threads, and the pull is complete at once. A pull not
    answered goes as frames that wait for nothing (the data connection: no thread of the client's either)."""
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=16)
    try:
        client.register({"a": torch.zeros(8), "b": torch.zeros(8)}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert {p.server for p in client.shard_map.parts} == {0, 1}
        handed: list[list[int]] = []
        real = client.transport.submit_each

        def submit_each(fn, shards=None):
            handed.append(list(range(client.num_shards)) if shards is None else list(shards))
            return real(fn, shards)

        client.transport.submit_each = submit_each  # type: ignore[method-assign]
        res = client.push({"a": torch.ones(8), "b": torch.ones(8)}, step=0, pull_after=(None, 0))
        assert all(r.pulled for r in res)
        out = {"a": torch.empty(8), "b": torch.empty(8)}
        pull = client.pull_async(out=out, min_versions=[r.ready_version for r in res], answered=res)
        assert pull.done() and handed == [[]]
        assert torch.equal(out["a"], torch.full((8,), -1.0)) and torch.equal(out["b"], torch.full((8,), -1.0))
        pull.result()
        assert client.versions == [1, 1]
        # Not answered (no pull_after): frames that wait for nothing, inline or not.
        res = client.push({"a": torch.ones(8), "b": torch.ones(8)}, step=1)
        client.pull_async(out=out, min_versions=[r.ready_version for r in res], answered=res).result()
        client.pull_async(out=out, min_versions=[r.ready_version for r in res], inline=True).result()
        assert handed == [[], [], []]
        assert torch.equal(out["a"], torch.full((8,), -2.0))
    finally:
        client.close()


def test_a_large_model_is_not_answered_and_is_pulled(cluster2):
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1)
    try:
        client.register({"big": torch.zeros(600_000)}, shardps.optim.SGD(lr=1.0), sync="asp")  # 2.4 MB
        res = client.push({"big": torch.ones(600_000)}, step=0, pull_after=(None, 0))
        assert all(not r.pulled for r in res)
        got = client.pull(min_versions=[r.ready_version for r in res], answered=res)
        assert torch.equal(got["big"], torch.full((600_000,), -1.0))
    finally:
        client.close()


def test_a_sync_switch_between_push_and_pull_discards_the_answer(cluster2):
    model = make_model()
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=256)
    try:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="asp")
        pulls = PullCounter(client)
        x, y = data(0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert pulls.calls == 0
        client.set_sync("ssp:1")  # the next push asks for weights as asp would; the shards answer under ssp:1
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert str(opt.sync) == "ssp:1" and all(r.pulled for r in opt.last_push)
        assert pulls.calls == 2  # answered, but under another mode than asked: pulled from both shards instead
    finally:
        client.close()


def test_pull_answered_needs_every_tensor(cluster2):
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1)
    try:
        client.register({"a": torch.zeros(4), "b": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
        res = client.push({"a": torch.ones(4), "b": torch.ones(4)}, step=0, pull_after=(None, 0))
        with pytest.raises(ValueError, match="pull them all"):
            client.pull(["a"], answered=res)
    finally:
        client.close()


def test_a_bad_pull_dtype_is_refused_and_changes_nothing(make_cluster):
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
    channel = grpc.insecure_channel(cluster.addresses[0])
    try:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
        data_ = torch.ones(4).view(torch.uint8).numpy().tobytes()
        req = ps_pb2.PushRequest(worker_id=0, step=0, base_version=0, pull_after=True, pull_dtype=77,
                                 chunk=ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32, data=data_, shape=[4]))
        with pytest.raises(grpc.RpcError) as e, FrameStub(cluster.addresses[0]) as stub:
            stub.Push([req], timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Push" in e.value.details()
        assert "77" in e.value.details()
        st = cluster.stores[0]
        assert st.job.version == 0 and st.job.pushes_total == 0
    finally:
        channel.close()
        client.close()


def test_an_answer_holding_another_jobs_tensors_fills_only_this_workers(make_cluster):
    """Pipeline stages share shards, each with its own tensors: a Push is answered with every tensor of its
    shard, and the worker takes its own."""
    cluster = make_cluster(1)
    a = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
    b = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
    try:
        a.register({"stage0.w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
        b.register({"stage1.w": torch.full((3,), 5.0)}, shardps.optim.SGD(lr=1.0), sync="asp")
        res = a.push({"stage0.w": torch.ones(4)}, step=0, pull_after=(None, 0))
        assert len(res[0].pulled) == 2  # both tensors of the shard
        pulls = PullCounter(a)
        got = a.pull(min_versions=[r.ready_version for r in res], answered=res)
        assert pulls.calls == 0 and set(got) == {"stage0.w"} and torch.equal(got["stage0.w"], torch.full((4,), -1.0))
    finally:
        a.close()
        b.close()
