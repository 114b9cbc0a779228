"""Server optimizer math against torch.optim, step for step (no network)."""

import pytest
import torch

from shardps import optim
from shardps.server.optim import PartInfo, make_optimizer

CASES = [
    (optim.Adam(), lambda p: torch.optim.Adam(p)),
    (optim.Adam(lr=1e-2, weight_decay=0.1, amsgrad=True),
     lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (optim.AdamW(lr=1e-2, betas=(0.8, 0.99)), lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99))),
    (optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (optim.SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    (optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
]


@pytest.mark.parametrize("spec, make_torch", CASES, ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("shape", [(64,), (16, 24)])
def test_matches_torch(spec, make_torch, shape):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=gen)
    ref = torch.nn.Parameter(w0.clone())
    topt = make_torch([ref])
    impl = make_optimizer(spec)
    w = w0.clone()
    info = PartInfo(tuple(shape), 0, w.numel())
    state = impl.init_state(w, info)
    for _ in range(50):
        grad = torch.randn(shape, generator=gen)
        ref.grad = grad.clone()
        topt.step()
        impl.step(w, grad.clone(), state, info)
    torch.testing.assert_close(w, ref.detach(), rtol=1e-5, atol=1e-6)


def test_state_is_tensors_only_and_sized_as_the_part():
    impl = make_optimizer(optim.Adam(amsgrad=True))
    st = impl.init_state(torch.zeros(3, 5), PartInfo((3, 5), 0, 15))
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert st["exp_avg"].shape == (3, 5)
