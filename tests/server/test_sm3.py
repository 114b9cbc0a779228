"""SM3-II: against a NumPy re-computation of the paper's equations, the
google-research sm3_test checks, and split across parts against whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardps import optim
from shardps.protos.optim import spec_from_name, spec_from_proto
from shardps.server.optim import PartInfo, make_optimizer, state_bytes
from shardps.server.optim.sm3 import SM3Impl
from tests.server.splitsim import row_bounds, run_split, run_whole

TOL = {"rtol": 1e-5, "atol": 1e-6}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(shape, steps, seed=0, sparse_rows=False):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=gen)
    grads = []
    for _ in range(steps):
        g = torch.randn(shape, generator=gen)
        if sparse_rows and len(shape) >= 1:  # some rows get no gradient: exercises eps and min/max
            g = g * (torch.rand(shape[:1], generator=gen) < 0.7).float().view(-1, *([1] * (len(shape) - 1)))
        grads.append(g)
    return w0, grads


def sm3_paper(w0, grads, lr, momentum, eps=1e-30):
    """SM3-II from the paper, with the cover sets written out: for rank k, the
    sets are S_(a, r) = {i : i_a = r}, one per axis a and index r; for rank <= 1
    every element is its own set (Adagrad). Float64."""
    w = w0.numpy().astype(np.float64)
    shape = w.shape
    if w.ndim >= 2:
        sets = [(a, r) for a in range(w.ndim) for r in range(shape[a])]
        covers = {i: [(a, i[a]) for a in range(w.ndim)] for i in np.ndindex(*shape)}
    else:
        sets = list(np.ndindex(*shape))
        covers = {i: [i] for i in np.ndindex(*shape)}
    mu = dict.fromkeys(sets, 0.0)
    gbar = np.zeros(shape)
    for g in grads:
        g = g.numpy().astype(np.float64)
        nu = np.zeros(shape)
        for i in np.ndindex(*shape):
            nu[i] = min(mu[r] for r in covers[i]) + g[i] ** 2
        for r in sets:
            members = [i for i in np.ndindex(*shape) if r in covers[i]]
            mu[r] = max(nu[i] for i in members)
        u = g / np.sqrt(nu + eps)
        if momentum > 0:
            gbar = momentum * gbar + (1 - momentum) * u
            w = w - lr * gbar
        else:
            w = w - lr * u
    return torch.from_numpy(np.asarray(w, dtype=np.float32))


@pytest.mark.parametrize("shape", [(), (7,), (6, 5), (3, 4, 5)], ids=str)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_matches_paper(shape, momentum):
    w0, grads = _data(shape, 40, sparse_rows=True)
    spec = optim.SM3(lr=0.05, momentum=momentum)
    w = run_whole(make_optimizer(spec), w0, grads)[0]
    assert not torch.equal(w, w0)
    torch.testing.assert_close(w, sm3_paper(w0, grads, 0.05, momentum), **TOL)


# -- google-research sm3_test.py: lr 0.1, momentum 0.9 -----------------------------


def _google_style(var, grad, steps=2, lr=0.1, mom=0.9):
    var_np = np.array(var, dtype=np.float64)
    grad_np = np.array(grad, dtype=np.float64)
    impl = make_optimizer(optim.SM3(lr=lr, momentum=mom))
    w = torch.tensor(var, dtype=torch.float32)
    info = PartInfo(tuple(w.shape), 0, w.numel())
    state = impl.init_state(w, info)
    gbar_np = np.zeros_like(var_np)
    if var_np.ndim >= 2:
        row_acc, col_acc = np.zeros([var_np.shape[0], 1]), np.zeros([1, var_np.shape[1]])
    else:
        acc = np.zeros_like(var_np)
    for _ in range(steps):
        impl.step(w, torch.tensor(grad, dtype=torch.float32), state, info)
        if var_np.ndim >= 2:
            acc = np.minimum(row_acc, col_acc) + np.square(grad_np)
            row_acc = np.amax(acc, axis=1, keepdims=True)
            col_acc = np.amax(acc, axis=0, keepdims=True)
        else:
            acc = acc + np.square(grad_np)
        p_grad = grad_np / np.sqrt(acc)
        gbar_np = mom * gbar_np + (1 - mom) * p_grad
        var_np = var_np - lr * gbar_np
        np.testing.assert_allclose(w.numpy(), var_np, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(state["momentum"].numpy(), gbar_np, rtol=1e-6, atol=1e-6)
    return state


def test_google_dense_scalar():
    _google_style(0.5, 0.1)


def test_google_dense_vector():
    _google_style([0.5, 0.3], [0.1, 0.1])


def test_google_dense_matrix():
    st = _google_style([[0.5, 0.5], [0.5, 0.5]], [[0.1, 0.05], [0.03, 0.02]])
    assert set(st) == {"step", "accumulator_0", "accumulator_1", "momentum"}


def test_google_zero_gradient_is_a_no_op():
    for eps in (1e-30, 0.0):
        impl = make_optimizer(optim.SM3(momentum=0.9, eps=eps))
        for shape in [(), (3,), (2, 3)]:
            w = torch.full(shape, 0.5)
            info = PartInfo(shape, 0, w.numel())
            st = impl.init_state(w, info)
            impl.step(w, torch.zeros(shape), st, info)
            assert torch.equal(w, torch.full(shape, 0.5)) and torch.equal(st["momentum"], torch.zeros(shape))


# -- split across parts --------------------------------------------------------------


@pytest.mark.parametrize("shape", [(31, 20), (7, 8, 10), (65,)], ids=str)
@pytest.mark.parametrize("nparts", [2, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_split_equals_whole(shape, nparts, momentum):
    impl = make_optimizer(optim.SM3(lr=0.05, momentum=momentum))
    w0, grads = _data(shape, 50, sparse_rows=True)
    whole, wstate, wcalls = run_whole(impl, w0, grads)
    split, states, calls = run_split(impl, w0, grads, row_bounds(shape, nparts))
    torch.testing.assert_close(split, whole, **TOL)
    assert calls == wcalls == ([("sm3.accumulators", "max")] * 50 if len(shape) >= 2 else [])
    if len(shape) >= 2:
        assert torch.equal(torch.cat([s["accumulator_0"] for s in states]), wstate["accumulator_0"])
        for i in range(1, len(shape)):  # replicated on every part, identical to whole
            for s in states:
                assert torch.equal(s[f"accumulator_{i}"], wstate[f"accumulator_{i}"])


def test_split_column_accumulator_is_a_max_over_all_rows():
    """One row's large gradient raises the column accumulator on every part."""
    impl = make_optimizer(optim.SM3())
    shape = (4, 3)
    g = torch.ones(shape)
    g[3, 1] = 10.0  # in part 1's rows only
    _, states, _ = run_split(impl, torch.zeros(shape), [g], row_bounds(shape, 2))
    for s in states:
        assert s["accumulator_1"].tolist() == [1.0, 100.0, 1.0]
    assert states[0]["accumulator_0"].tolist() == [1.0, 1.0]
    assert states[1]["accumulator_0"].tolist() == [1.0, 100.0]


# -- state, spec ---------------------------------------------------------------------


def test_state_bytes():
    n = m = 1024
    info = PartInfo((n, m), 0, n * m)
    st = make_optimizer(optim.SM3()).init_state(torch.zeros(n, m), info)
    assert set(st) == {"step", "accumulator_0", "accumulator_1"}
    assert st["step"].shape == () and st["step"].dtype == torch.float32
    assert state_bytes(st) == (n + m) * 4 + 4
    st = make_optimizer(optim.SM3(momentum=0.9)).init_state(torch.zeros(n, m), info)
    assert state_bytes(st) == (n + m + n * m) * 4 + 4
    st = make_optimizer(optim.SM3()).init_state(torch.zeros(2, 3, 4), PartInfo((2, 3, 4), 0, 24))
    assert state_bytes(st) == (2 + 3 + 4) * 4 + 4
    st = make_optimizer(optim.SM3()).init_state(torch.zeros(10), PartInfo((10,), 0, 10))
    assert state_bytes(st) == 10 * 4 + 4


def test_part_must_be_a_row_block():
    with pytest.raises(ValueError, match="whole rows"):
        make_optimizer(optim.SM3()).init_state(torch.zeros(7), PartInfo((4, 6), 3, 10))


def test_spec():
    s = optim.SM3()
    assert (s.lr, s.momentum, s.eps) == (0.1, 0.0, 1e-30)
    assert optim.SM3.elementwise is False
    assert isinstance(make_optimizer(s), SM3Impl)
    for spec in (s, optim.SM3(lr=0.3, momentum=0.9, eps=0.0)):
        assert spec_from_proto(spec.to_proto()) == spec
        assert spec_from_name("sm3", **spec.params()) == spec


@pytest.mark.parametrize("kw, match", [
    ({"lr": -1.0}, "lr must be >= 0"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ({"eps": -1e-30}, "eps must be >= 0"),
    ({"lr": float("inf")}, "lr must be a finite number"),
    ({"momentum": True}, "momentum must be a finite number"),
])
def test_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        optim.SM3(**kw)


def test_paper_reference_is_independent_of_axis_order():
    """Sanity check of the reference itself: transposing the problem transposes the result."""
    w0, grads = _data((3, 4), 5)
    a = sm3_paper(w0, grads, 0.1, 0.0)
    b = sm3_paper(w0.T.contiguous(), [g.T.contiguous() for g in grads], 0.1, 0.0)
    torch.testing.assert_close(a, b.T)
