"""BSP over the servers equals one process training on the union of the batches."""

import copy

import pytest
import torch
from torch import nn

import shardps
from tests.helpers import run_workers

STEPS = 20
WORKERS = 3
BATCH = 24  # 8 samples per worker


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 10, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


@pytest.mark.parametrize("frame_inline_bytes", [None, 0], ids=["pulls-framed-under-lock", "pulls-framed-by-thread"])
def test_bsp_three_workers_equal_one_process_with_torch_adam(cluster2, frame_inline_bytes):
    if frame_inline_bytes is not None:  # every Pull framed outside the lock, as large ones are
        for st in cluster2.stores:
            st.reader.frame_inline_bytes = frame_inline_bytes
    reference = make_model()
    topt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = data(step)
        nn.functional.cross_entropy(reference(x), y).backward()
        topt.step()
        topt.zero_grad()

    base = make_model()

    def worker(k: int) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(base)
        if k:  # only worker 0's initial values count: the others start elsewhere
            for p in model.parameters():
                nn.init.normal_(p)
        # Small parts so that every matrix is split in row blocks across both shards.
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=WORKERS, part_bytes=256)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp")
        for step in range(STEPS):
            x, y = data(step)
            mine = slice(k * BATCH // WORKERS, (k + 1) * BATCH // WORKERS)
            nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
        client.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    results = run_workers(worker, WORKERS)
    expected = dict(reference.named_parameters())
    for k, weights in enumerate(results):
        for name, w in weights.items():
            torch.testing.assert_close(w, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, name=name: f"worker {k}, {name}: {m}")
    # The matrices really were split across both shards, and each shard stepped once per step.
    for store in cluster2.stores:
        assert store.job.version == STEPS
        assert any(len(store.reader.weights(n)) >= 1 for n in ("0.weight", "2.weight"))
    assert all(len(s.names()) > 0 for s in cluster2.stores)
    assert all(st.applier.staleness_counts == {0: STEPS * WORKERS} for st in cluster2.stores)
