"""The CUDA path: gradients from the device (side-stream copies into pinned memory while backward runs),
weights back to the device, with and without overlap, over gRPC and shared memory. Skipped without a GPU;
benchmarks/gpu_check.sh runs these on a CUDA machine, then the step times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def train(addresses, device: str, **kw) -> dict[str, torch.Tensor]:
    model = make_model().to(device)
    with shardps.connect(addresses, part_bytes=4096, shm=kw.pop("shm", True)) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp", **kw)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kw", [dict(), dict(overlap=True, bucket_bytes=64 << 10), dict(shm=False),
                                dict(overlap=True, shm=False, bucket_bytes=64 << 10)],
                         ids=["plain", "overlap", "grpc", "overlap-grpc"])
def test_cuda_training_matches_cpu(make_cluster, kw):
    cpu = train(make_cluster(2).addresses, "cpu")
    gpu = train(make_cluster(2).addresses, "cuda", **dict(kw))
    for n, w in cpu.items():  # the device's matmuls round differently from the CPU's
        torch.testing.assert_close(gpu[n], w, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_cuda_overlap_is_exact_against_cuda_without(make_cluster):
    plain = train(make_cluster(2).addresses, "cuda")
    over = train(make_cluster(2).addresses, "cuda", overlap=True, bucket_bytes=64 << 10)
    for n, w in plain.items():
        assert torch.equal(over[n], w), n


def test_cuda_bf16_both_ways(make_cluster):
    w = train(make_cluster(2).addresses, "cuda", grad_dtype=torch.bfloat16, pull_dtype=torch.bfloat16,
              overlap=True)
    assert all(torch.isfinite(t).all() for t in w.values())
    assert all(torch.equal(t, t.to(torch.bfloat16).float()) for t in w.values())  # weights came down in bf16
