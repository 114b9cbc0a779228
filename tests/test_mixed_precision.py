"""Mixed precision: half-precision gradients, fp32 masters, distributed dynamic loss scaling."""

import copy

import pytest
import torch
from torch import nn

import shardps
from tests.helpers import run_workers


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_are_applied_to_fp32_masters(cluster2, grad_dtype):
    torch.manual_seed(0)
    model = nn.Linear(40, 30)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    with shardps.connect(cluster2.addresses, part_bytes=1024) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=1.0),
                                           grad_dtype=grad_dtype)
        model(torch.randn(8, 40)).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        stats = client.stats()
        assert sum(s["push_bytes_total"] for s in stats) == sum(g.numel() for g in grads.values()) * 2
        for n, p in model.named_parameters():
            expected = w0[n] - grads[n].to(grad_dtype).float()  # fp32 master minus the sent gradient
            assert torch.equal(p.detach(), expected), n
        # Servers can also serve half-precision weights.
        half = client.pull(dtype=torch.bfloat16)
        assert all(t.dtype == torch.bfloat16 for t in half.values())
        assert torch.equal(half["weight"], model.weight.detach().to(torch.bfloat16))


STEPS = 8
INF_STEP = 3
WORKERS = 3
BATCH = 12


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g)


def test_loss_scaling_matches_gradscaler_and_skips_an_inf_step_everywhere(cluster2):
    scaling = shardps.LossScaling(init_scale=2.0**16, growth_interval=3)
    # Reference: one process, torch.amp.GradScaler, the same inf injected.
    ref = _model()
    topt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)
    ref_scales = []
    for step in range(STEPS):
        x, y = _data(step)
        scaler.scale(nn.functional.mse_loss(ref(x), y)).backward()
        if step == INF_STEP:
            ref[2].weight.grad[0, 0] = float("inf")
        scaler.step(topt)
        scaler.update()
        topt.zero_grad()
        ref_scales.append(scaler.get_scale())

    base = _model()

    def worker(k: int):
        model = copy.deepcopy(base)
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=WORKERS, part_bytes=64)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2),
                                           loss_scaling=scaling)
        scales, before_inf = [], None
        for step in range(STEPS):
            x, y = _data(step)
            mine = slice(k * BATCH // WORKERS, (k + 1) * BATCH // WORKERS)
            opt.scale(nn.functional.mse_loss(model(x[mine]), y[mine])).backward()
            if step == INF_STEP:
                before_inf = {n: p.detach().clone() for n, p in model.named_parameters()}
                if k == 1:  # one worker, one tensor (held by one shard only)
                    model[2].weight.grad[0, 0] = float("inf")
            opt.step()
            opt.zero_grad()
            if step == INF_STEP:  # no shard applied that step: nothing moved anywhere
                for n, p in model.named_parameters():
                    assert torch.equal(p.detach(), before_inf[n]), n
            scales.append(opt.loss_scale)
        client.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, scales

    results = run_workers(worker, WORKERS)
    expected = dict(ref.named_parameters())
    for weights, scales in results:
        assert scales == ref_scales  # the same scale, everywhere, after every step
        for n, w in weights.items():
            torch.testing.assert_close(w, expected[n].detach(), rtol=1e-5, atol=1e-6)
    assert ref_scales[INF_STEP] == ref_scales[INF_STEP - 1] * 0.5
    for store in cluster2.stores:
        assert store.applier.skipped_steps_total == 1
        assert store.job.version == STEPS and store.applier.applied_updates_total == STEPS - 1
        assert store.applier.loss_scale == ref_scales[-1]


def test_export_state_matches_torch_adam(cluster2):
    torch.manual_seed(0)
    model = nn.Linear(20, 10)
    ref = copy.deepcopy(model)
    topt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    with shardps.connect(cluster2.addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2))
        for step in range(5):
            x = torch.randn(4, 20, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            ref(x).sum().backward()
            opt.step()
            topt.step()
            opt.zero_grad()
            topt.zero_grad()
        state = client.export_state()
        stats = client.stats()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state[n]["weight"], p.detach(), rtol=1e-5, atol=1e-6)
        (part,) = state[n]["optimizer"].values()  # small tensors: one part each
        torch.testing.assert_close(part["exp_avg"].view(-1), topt.state[p]["exp_avg"].view(-1), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(part["exp_avg_sq"].view(-1), topt.state[p]["exp_avg_sq"].view(-1),
                                   rtol=1e-5, atol=1e-9)
        assert part["step"].item() == 5
    per_tensor = {t["name"]: t["optimizer_state_bytes"] for s in stats for t in s["tensors"]}
    assert per_tensor == {"weight": 2 * 200 * 4 + 4, "bias": 2 * 10 * 4 + 4}
