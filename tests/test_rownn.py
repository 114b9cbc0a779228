"""shardps.nn row modules inside a model: pooled lookups as torch's, bsp over workers as one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardps
from shardps.optim import SGD, SparseAdam
from tests.helpers import run_workers

STEPS = 12
WORKERS = 2
BATCH = 8  # 4 ids per worker


class Model(nn.Module):
    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = table
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 10, (BATCH,), generator=g)
    ids[1] = ids[0]  # a repeated id in worker 0's half
    return ids, torch.randn(BATCH, generator=g)


def test_bsp_two_workers_equal_one_process_on_the_union_batch(cluster2):
    # Built here, not in the threads: Model seeds torch's global generator, which the threads would share.
    models = [Model(shardps.nn.Embedding(10, 4, optimizer=SparseAdam(lr=0.05))) for _ in range(WORKERS)]

    def worker(k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = models[k]
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=WORKERS)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
        start = client.rows.pull("emb", torch.arange(10))
        for step in range(STEPS):
            ids, y = batch(step)
            mine = slice(k * BATCH // WORKERS, (k + 1) * BATCH // WORKERS)
            F.mse_loss(model(ids[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
        rows = client.rows.pull("emb", torch.arange(10))
        client.close()
        return torch.stack([start, rows]), {n: p.detach().clone() for n, p in model.named_parameters()}

    results = run_workers(worker, WORKERS)
    start = results[0][0][0]
    ref = Model(nn.Embedding(10, 4, sparse=True))
    with torch.no_grad():
        ref.emb.weight.copy_(start)
    sparse = torch.optim.SparseAdam([ref.emb.weight], lr=0.05)
    dense = torch.optim.SGD(ref.head.parameters(), lr=0.1)
    for step in range(STEPS):
        ids, y = batch(step)
        F.mse_loss(ref(ids), y).backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()
    for rows, weights in results:
        torch.testing.assert_close(rows[1], ref.emb.weight.detach(), rtol=0, atol=1e-6)
        for name, w in weights.items():
            torch.testing.assert_close(w, dict(ref.named_parameters())[name].detach(), rtol=1e-5, atol=1e-6)
    assert sum(s.rows.tables["emb"].steps for s in cluster2.stores) == STEPS * len(cluster2.stores)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_pools_as_torch_forward_and_backward(make_cluster, mode):
    cluster = make_cluster(1)
    table = shardps.nn.EmbeddingBag(None, 4, mode, optimizer=SGD(lr=1.0))
    model = Model(table)
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.0))
        ids = torch.tensor([[3, 5, 3], [2**40, 5, 7]])
        weight = client.rows.pull("emb", torch.arange(8)).requires_grad_()
        weight2 = torch.cat([weight, client.rows.pull("emb", torch.tensor([2**40]))])
        remap = torch.tensor([[3, 5, 3], [8, 5, 7]])
        want = F.embedding_bag(remap, weight2, mode=mode)
        got = table(ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        before = client.rows.pull("emb", torch.tensor([3, 5, 7, 2**40]))
        got.sum().backward()
        want.sum().backward()
        opt.step()
        after = client.rows.pull("emb", torch.tensor([3, 5, 7, 2**40]))
        grad3 = torch.autograd.grad(F.embedding_bag(remap, weight2, mode=mode).sum(), weight2)[0]
        torch.testing.assert_close(before - after, grad3[[3, 5, 7, 8]], rtol=0, atol=1e-6)


def test_from_pretrained_rows_start_as_given(make_cluster):
    cluster = make_cluster(2)
    given = torch.arange(12.0).view(6, 2)
    model = nn.Sequential(shardps.nn.Embedding.from_pretrained(given, name="pre"), nn.Linear(2, 1))
    with shardps.connect(cluster.addresses) as client:
        shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.1))
        assert torch.equal(model[0](torch.tensor([5, 0, 5])), given[[5, 0, 5]])
        with pytest.raises(IndexError, match="out of range"):
            model[0](torch.tensor([6]))
    with pytest.raises(RuntimeError, match="DistributedOptimizer"):
        shardps.nn.Embedding(4, 2)(torch.tensor([1]))


@pytest.mark.parametrize("optimizer", ["sgd", "sparse_adam"])
def test_every_x_accumulates_row_gradients_and_pushes_their_mean_once_every_x_steps(make_cluster, optimizer):
    """every:3, one worker, 9 local steps: the rows and the dense weights equal one process that averages 3
    steps' gradients and steps once (gradient accumulation), the table stepped 3 times, not 9. The ids
    repeat within a step and across the steps held (their rows summed, then the mean over the steps)."""
    every, steps = 3, 9
    cluster = make_cluster(2)
    make = {"sgd": lambda: SGD(lr=0.5), "sparse_adam": lambda: SparseAdam(lr=0.05)}[optimizer]
    model = Model(shardps.nn.Embedding(10, 4, optimizer=make()))
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync=f"every:{every}")
        start = client.rows.pull("emb", torch.arange(10))
        for step in range(steps):
            ids, y = batch(step)
            F.mse_loss(model(ids), y).backward()
            opt.step()
            opt.zero_grad()
            if step % every < every - 1:  # held, not pushed: the shards' rows are as before this round
                assert sum(s.rows.tables["emb"].steps for s in cluster.stores) == step // every * len(cluster.stores)
        rows = client.rows.pull("emb", torch.arange(10))
    ref = Model(nn.Embedding(10, 4, sparse=optimizer == "sparse_adam"))
    with torch.no_grad():
        ref.emb.weight.copy_(start)
    sparse = (torch.optim.SGD if optimizer == "sgd" else torch.optim.SparseAdam)(
        [ref.emb.weight], lr=0.5 if optimizer == "sgd" else 0.05)
    dense = torch.optim.SGD(ref.head.parameters(), lr=0.1)
    for step in range(steps):
        ids, y = batch(step)
        (F.mse_loss(ref(ids), y) / every).backward()  # the mean over the steps held
        if step % every == every - 1:
            sparse.step()
            dense.step()
            sparse.zero_grad()
            dense.zero_grad()
    torch.testing.assert_close(rows, ref.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    for name, w in model.named_parameters():
        torch.testing.assert_close(w.detach(), dict(ref.named_parameters())[name].detach(), rtol=1e-5, atol=1e-6)
    assert sum(s.rows.tables["emb"].steps for s in cluster.stores) == steps // every * len(cluster.stores)
