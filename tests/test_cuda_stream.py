"""Streamed weights on a CUDA worker: pulls staged through pinned memory, keep="host" copies on the side stream
(the compute stream waits on an event). Skipped without a GPU; benchmarks/gpu_check.sh runs it on a CUDA machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def train(addresses, device: str, stream: shardps.Stream | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).to(device)
    with shardps.connect(addresses, part_bytes=4096) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), stream=stream)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        if opt.stream is not None:
            assert opt.stream.held() == {}
            assert opt.stream.peak_live_bytes < opt.stream.model_bytes
            return opt.stream.weights()
        return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("keep", ["server", "host"])
def test_streamed_cuda_matches_resident_cpu(make_cluster, keep):
    cpu = train(make_cluster(2).addresses, "cpu", None)
    cuda = train(make_cluster(2).addresses, "cuda", shardps.Stream(300_000, keep=keep))
    for n, w in cpu.items():
        torch.testing.assert_close(cuda[n], w, rtol=1e-4, atol=1e-5, msg=f"{n}: streamed on CUDA")
