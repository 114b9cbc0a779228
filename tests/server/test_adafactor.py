"""Adafactor: against torch.optim.Adafactor where the rules coincide, against an
independent NumPy re-computation of the HF rule everywhere, and split across
parts against whole."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardps import optim
from shardps.protos.optim import spec_from_name, spec_from_proto
from shardps.server.optim import PartInfo, make_optimizer, state_bytes
from shardps.server.optim.adafactor import AdafactorImpl
from tests.server.splitsim import row_bounds, run_split, run_whole

SHAPES = [(64,), (32, 48), (4, 32, 48)]
TOL = {"rtol": 1e-5, "atol": 1e-6}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(shape, steps, gscale, wscale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=gen) * wscale
    grads = [torch.randn(shape, generator=gen) * gscale for _ in range(steps)]
    return w0, grads


def _run(spec, w0, grads):
    return run_whole(make_optimizer(spec), w0, grads)[0]


# -- torch.optim.Adafactor -------------------------------------------------------
#
# torch's rule equals HF's with relative_step=True, warmup_init=False,
# scale_parameter=True, beta1=None, weight_decay=0 under this mapping:
#   torch lr=1e-2 (the relative-step cap: rho = min(lr, t^-0.5)),
#   beta2_decay=decay_rate, eps=(eps1, eps2), d=clip_threshold.
# torch clamps with eps1 where HF adds it; the two agree only while
# g^2 >> eps1 and g^2 stays a normal fp32 number. At gradient scale 1e-20,
# torch 2.13 returns NaN (g^2 underflows to subnormals, R (x) C to 0, rsqrt
# to inf), so the tiny-gradient case is checked against the NumPy HF rule.

TORCH_CASES = [
    # (spec kwargs, torch kwargs, theta scale)
    ({}, {}, 1.0),
    ({"clip_threshold": 2.0, "decay_rate": -0.5}, {"d": 2.0, "beta2_decay": -0.5}, 1.0),
    ({}, {}, 1e-5),  # RMS(theta) below eps2: alpha = eps2 * rho
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gscale", [1.0, 1e3])
@pytest.mark.parametrize("case", range(len(TORCH_CASES)))
def test_matches_torch_adafactor(shape, gscale, case):
    skw, tkw, wscale = TORCH_CASES[case]
    w0, grads = _data(shape, 120, gscale, wscale)
    ref = torch.nn.Parameter(w0.clone())
    kw = {"lr": 1e-2, "beta2_decay": -0.8, "eps": (1e-30, 1e-3), "d": 1.0, "weight_decay": 0.0} | tkw
    topt = torch.optim.Adafactor([ref], **kw, foreach=False, maximize=False)
    for g in grads:
        ref.grad = g.clone()
        topt.step()
    w = _run(optim.Adafactor(**skw), w0, grads)
    assert not torch.equal(w, w0)
    torch.testing.assert_close(w, ref.detach(), **TOL)


# -- independent NumPy re-computation of the HF rule ------------------------------


def hf_reference(w0, grads, *, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8,
                 beta1=None, weight_decay=0.0, scale_parameter=True, relative_step=True,
                 warmup_init=False):
    """HF transformers.Adafactor.step, transcribed to NumPy float64."""
    w = w0.numpy().astype(np.float64)
    factored = w.ndim >= 2
    if factored:
        row = np.zeros(w.shape[:-1])
        col = np.zeros(w.shape[:-2] + w.shape[-1:])
    else:
        v = np.zeros(w.shape)
    m = np.zeros(w.shape)
    for t, g in enumerate(grads, start=1):
        g = g.numpy().astype(np.float64)
        rms = np.sqrt(np.mean(w * w))
        rel = min(1e-6 * t if warmup_init else 1e-2, 1.0 / math.sqrt(t)) if relative_step else lr
        alpha = rel * (max(eps[1], rms) if scale_parameter else 1.0)
        beta2t = 1.0 - t**decay_rate
        g2 = g * g + eps[0]
        if factored:
            row = beta2t * row + (1 - beta2t) * g2.mean(axis=-1)
            col = beta2t * col + (1 - beta2t) * g2.mean(axis=-2)
            r = row / row.mean(axis=-1, keepdims=True)
            u = g / np.sqrt(r[..., :, None] * col[..., None, :])
        else:
            v = beta2t * v + (1 - beta2t) * g2
            u = g / np.sqrt(v)
        u = u / max(1.0, np.sqrt(np.mean(u * u)) / clip_threshold)
        u = u * alpha
        if beta1 is not None:
            m = beta1 * m + (1 - beta1) * u
            u = m
        if weight_decay != 0:
            w = w - weight_decay * alpha * w
        w = w - u
    return torch.from_numpy(w.astype(np.float32))


HF_CASES = [
    {},
    {"beta1": 0.9},
    {"weight_decay": 0.05},
    {"scale_parameter": False, "relative_step": False, "lr": 1e-3},
    {"relative_step": False, "lr": 1e-2, "beta1": 0.8, "weight_decay": 0.1},
    {"warmup_init": True},
    {"warmup_init": True, "beta1": 0.9, "weight_decay": 0.01, "clip_threshold": 0.5},
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gscale", [1.0, 1e-20, 1e3])
@pytest.mark.parametrize("kw", HF_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
def test_matches_hf_rule(shape, gscale, kw):
    w0, grads = _data(shape, 100, gscale)
    w = _run(optim.Adafactor(**kw), w0, grads)
    assert torch.isfinite(w).all() and not torch.equal(w, w0)
    torch.testing.assert_close(w, hf_reference(w0, grads, **kw), **TOL)


def test_tiny_gradients_are_regularised_by_eps1():
    """g ~ 1e-20: V ~ eps1 = 1e-30, so U ~ g / 1e-15 ~ 1e-5 and the step is ~1e-7."""
    w0, grads = _data((32, 48), 1, 1e-20)
    w = _run(optim.Adafactor(), w0, grads)
    step = (w0 - w).abs().max().item()
    assert 1e-9 < step < 1e-6


# -- split across parts --------------------------------------------------------------

SPLIT_SPECS = [
    optim.Adafactor(beta1=0.9, weight_decay=0.01),
    optim.Adafactor(),
    optim.Adafactor(relative_step=False, scale_parameter=False, lr=1e-2, beta1=0.5),
]


@pytest.mark.parametrize("shape", [(31, 20), (7, 8, 10), (65,)], ids=str)
@pytest.mark.parametrize("nparts", [2, 3])
@pytest.mark.parametrize("spec", SPLIT_SPECS, ids=["beta1+wd", "defaults", "manual-lr+beta1"])
def test_split_equals_whole(shape, nparts, spec):
    impl = make_optimizer(spec)
    w0, grads = _data(shape, 50, 1.0)
    whole, wstate, wcalls = run_whole(impl, w0, grads)
    split, states, calls = run_split(impl, w0, grads, row_bounds(shape, nparts))
    torch.testing.assert_close(split, whole, **TOL)
    assert calls == wcalls
    if len(shape) >= 2:
        torch.testing.assert_close(torch.cat([s["exp_avg_sq_row"] for s in states]), wstate["exp_avg_sq_row"])
    if len(shape) == 2:
        for s in states:  # the column statistics are replicated, identically
            assert torch.equal(s["exp_avg_sq_col"], states[0]["exp_avg_sq_col"])
        torch.testing.assert_close(states[0]["exp_avg_sq_col"], wstate["exp_avg_sq_col"])
    elif len(shape) >= 3:
        torch.testing.assert_close(torch.cat([s["exp_avg_sq_col"] for s in states]), wstate["exp_avg_sq_col"])


def test_split_2d_differs_from_factoring_each_block_alone():
    """The split result is the whole one, not that of each block factored on its own."""
    spec = optim.Adafactor(beta1=0.9)
    w0, grads = _data((30, 20), 20, 1.0)
    grads = [g * torch.linspace(0.1, 10, 30)[:, None] for g in grads]  # rows of different scales
    whole = _run(spec, w0, grads)
    blocks = torch.cat([_run(spec, w0[a:b], [g[a:b] for g in grads]) for a, b in ((0, 10), (10, 30))])
    split, _, _ = run_split(make_optimizer(spec), w0, grads, [(0, 200), (200, 600)])
    torch.testing.assert_close(split, whole, **TOL)
    assert (blocks - whole).abs().max() > 1e-4


@pytest.mark.parametrize("shape, spec, per_step", [
    ((8, 6), optim.Adafactor(), [("adafactor.stats", "sum"), ("adafactor.update_sumsq", "sum")]),
    ((8, 6), optim.Adafactor(scale_parameter=False, relative_step=False, lr=1e-3),
     [("adafactor.stats", "sum"), ("adafactor.update_sumsq", "sum")]),
    ((2, 8, 6), optim.Adafactor(), [("adafactor.stats", "sum"), ("adafactor.update_sumsq", "sum")]),
    ((2, 8, 6), optim.Adafactor(scale_parameter=False, relative_step=False, lr=1e-3),
     [("adafactor.update_sumsq", "sum")]),
    ((10,), optim.Adafactor(), [("adafactor.stats", "sum"), ("adafactor.update_sumsq", "sum")]),
])
def test_reduce_calls(shape, spec, per_step):
    w0, grads = _data(shape, 3, 1.0)
    assert run_whole(make_optimizer(spec), w0, grads)[2] == per_step * 3


# -- state, spec ---------------------------------------------------------------------


def test_state_bytes_are_factored():
    impl = make_optimizer(optim.Adafactor())
    n = m = 1024
    st = impl.init_state(torch.zeros(n, m), PartInfo((n, m), 0, n * m))
    assert set(st) == {"step", "exp_avg_sq_row", "exp_avg_sq_col"}
    assert all(isinstance(v, torch.Tensor) for v in st.values())
    assert st["step"].shape == () and st["step"].dtype == torch.float32
    assert state_bytes(st) == (n + m) * 4 + 4
    st = make_optimizer(optim.Adafactor(beta1=0.9)).init_state(torch.zeros(n, m), PartInfo((n, m), 0, n * m))
    assert state_bytes(st) == (n + m + n * m) * 4 + 4
    st = impl.init_state(torch.zeros(4, 8, 6), PartInfo((4, 8, 6), 0, 192))
    assert state_bytes(st) == 4 * (8 + 6) * 4 + 4
    st = impl.init_state(torch.zeros(100), PartInfo((100,), 0, 100))
    assert state_bytes(st) == 100 * 4 + 4


def test_part_must_be_a_row_block():
    impl = make_optimizer(optim.Adafactor())
    with pytest.raises(ValueError, match="whole rows"):
        impl.init_state(torch.zeros(7), PartInfo((4, 6), 3, 10))


def test_spec_defaults_are_hf():
    s = optim.Adafactor()
    assert (s.lr, s.eps, s.clip_threshold, s.decay_rate, s.beta1, s.weight_decay) == (
        None, (1e-30, 1e-3), 1.0, -0.8, None, 0.0)
    assert (s.scale_parameter, s.relative_step, s.warmup_init) == (True, True, False)
    assert optim.Adafactor.elementwise is False
    assert isinstance(make_optimizer(s), AdafactorImpl)


@pytest.mark.parametrize("spec", [
    optim.Adafactor(),
    optim.Adafactor(lr=1e-3, relative_step=False, scale_parameter=False, beta1=0.9, eps=(0.0, 1e-4)),
    optim.Adafactor(warmup_init=True, weight_decay=0.01, clip_threshold=2.0, decay_rate=-0.5),
])
def test_wire_round_trip(spec):
    assert spec_from_proto(spec.to_proto()) == spec
    assert spec_from_name("Adafactor", **spec.params()) == spec


@pytest.mark.parametrize("kw, match", [
    ({"lr": 1e-3}, "Cannot combine manual `lr` and `relative_step=True` options"),
    ({"warmup_init": True, "relative_step": False, "lr": 1e-3}, "`warmup_init=True` requires `relative_step=True`"),
    ({"relative_step": False}, "requires a manual `lr`"),
    ({"eps": (1e-30,)}, "eps must be a pair"),
    ({"eps": (-1.0, 1e-3)}, r"eps\[0\] must be >= 0"),
    ({"clip_threshold": 0.0}, "clip_threshold must be > 0"),
    ({"decay_rate": 0.5}, "decay_rate must be <= 0"),
    ({"beta1": 1.0}, "beta1 must be None or in"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"relative_step": False, "lr": float("nan")}, "lr must be a finite number"),
    ({"scale_parameter": 1}, "scale_parameter must be a bool"),
])
def test_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        optim.Adafactor(**kw)
