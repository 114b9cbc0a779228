"""every:X equals gradient accumulation over X micro-batches, with X times fewer pushes."""

import copy

import torch
from torch import nn

import shardps
from tests.helpers import run_workers

X = 4
ROUNDS = 5
WORKERS = 2
MICRO = 6


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def micro_batch(rnd: int, worker: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rnd * 1000 + worker * 100 + i)
    return torch.randn(MICRO, 8, generator=g), torch.randint(0, 4, (MICRO,), generator=g)


def test_every_4_equals_accumulation_and_pushes_a_quarter(cluster2):
    reference = make_model()
    topt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for rnd in range(ROUNDS):
        for w in range(WORKERS):  # one process: every micro-batch of every worker
            for i in range(X):
                x, y = micro_batch(rnd, w, i)
                (nn.functional.cross_entropy(reference(x), y) / (X * WORKERS)).backward()
        topt.step()
        topt.zero_grad()

    base = make_model()

    def worker(k: int) -> tuple[dict[str, torch.Tensor], int, int]:
        model = copy.deepcopy(base)
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=WORKERS, part_bytes=128)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=f"every:{X}")
        for rnd in range(ROUNDS):
            for i in range(X):
                x, y = micro_batch(rnd, k, i)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        client.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.local_steps, opt.pushes

    results = run_workers(worker, WORKERS)
    expected = dict(reference.named_parameters())
    for weights, steps, pushes in results:
        assert steps == ROUNDS * X
        assert pushes == ROUNDS == steps // X
        for name, w in weights.items():
            torch.testing.assert_close(w, expected[name].detach(), rtol=1e-5, atol=1e-6)
    for store in cluster2.stores:
        assert store.job.pushes_total == WORKERS * ROUNDS
        assert store.job.version == ROUNDS
        assert str(store.job.sync) == "every:4"
