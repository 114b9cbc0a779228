"""The optimizers as the servers run them, through gRPC, against their references.

Every case registers tensors on real servers, pushes a gradient per step and
pulls the weights at the end; the reference is torch.optim (Adam, AdamW,
Adafactor where their rules coincide) or an independent NumPy transcription
(HF Adafactor's other switches, SM3-II from the paper).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

import shardps
from shardps import optim
from tests.server.test_adafactor import hf_reference
from tests.server.test_sm3 import sm3_paper

SHAPES = [(64,), (32, 48), (4, 32, 48)]


def _data(shapes, steps, gscale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w0 = {f"t{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    grads = [{n: torch.randn(w.shape, generator=gen) * gscale for n, w in w0.items()} for _ in range(steps)]
    return w0, grads


def on_servers(addresses, spec, w0, grads, *, sync="bsp", max_whole_bytes=256 << 20, part_bytes=None, shm=True):
    with shardps.connect(addresses, part_bytes=part_bytes, shm=shm) as client:
        client.register(w0, spec, sync=sync, max_whole_bytes=max_whole_bytes)
        for step, g in enumerate(grads):
            res = client.push(g, step=step)
            assert all(r.applied for r in res if r.version), res
        out = client.pull(min_versions=len(grads))
        return out, client.shard_map


def torch_reference(make_opt, w0, grads):
    params = {n: torch.nn.Parameter(w.clone()) for n, w in w0.items()}
    opt = make_opt(list(params.values()))
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


ADAM_CASES = {
    "adam": (optim.Adam(), lambda p: torch.optim.Adam(p)),
    "adam-amsgrad-l2": (optim.Adam(lr=1e-2, weight_decay=0.1, amsgrad=True),
                        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "adamw": (optim.AdamW(lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2)),
    "adamw-amsgrad": (optim.AdamW(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05, amsgrad=True),
                      lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05, amsgrad=True)),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_family_300_steps_vs_torch(cluster2, case):
    spec, make = ADAM_CASES[case]
    w0, grads = _data([(64,), (32, 48), (300, 20)], 300)
    got, _ = on_servers(cluster2.addresses, spec, w0, grads, part_bytes=4096)  # split over both shards
    ref = torch_reference(make, w0, grads)
    for n in w0:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{case} {n}: {m}")


@pytest.mark.parametrize("gscale", [1.0, 1e3])
def test_adafactor_vs_torch_adafactor(cluster2, gscale):
    w0, grads = _data(SHAPES, 100, gscale)
    got, _ = on_servers(cluster2.addresses, optim.Adafactor(), w0, grads)
    ref = torch_reference(lambda p: torch.optim.Adafactor(p, lr=1e-2, eps=(1e-30, 1e-3), foreach=False), w0, grads)
    for n in w0:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6)


HF_SWITCHES = [
    dict(beta1=0.9),
    dict(weight_decay=0.01),
    dict(lr=1e-2, relative_step=False, scale_parameter=False),
    dict(warmup_init=True, beta1=0.9, weight_decay=0.001),
]


@pytest.mark.parametrize("kw", HF_SWITCHES, ids=str)
@pytest.mark.parametrize("gscale", [1e-20, 1.0])
def test_adafactor_switches_vs_hf_rule(cluster2, kw, gscale):
    w0, grads = _data(SHAPES, 60, gscale, seed=1)
    got, _ = on_servers(cluster2.addresses, optim.Adafactor(**kw), w0, grads)
    for n, w in w0.items():
        ref = hf_reference(w, [g[n] for g in grads], **kw)
        np.testing.assert_allclose(got[n].numpy(), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sm3_vs_paper(cluster2, momentum):
    w0, grads = _data([(7,), (6, 5), (3, 4, 5)], 60, seed=2)
    got, _ = on_servers(cluster2.addresses, optim.SM3(lr=0.1, momentum=momentum), w0, grads)
    for n, w in w0.items():
        ref = sm3_paper(w, [g[n] for g in grads], lr=0.1, momentum=momentum)
        np.testing.assert_allclose(got[n].numpy(), np.asarray(ref), rtol=1e-5, atol=1e-6)


SPLIT_SPECS = {
    "adafactor": optim.Adafactor(beta1=0.9, weight_decay=0.01),
    "adafactor-manual-lr": optim.Adafactor(lr=1e-2, relative_step=False, scale_parameter=False),
    "sm3": optim.SM3(lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("name", [*SPLIT_SPECS, "sm3-frames"])
def test_tensor_split_across_2_servers_equals_1_server(make_cluster, name):
    """The two shards serve in this process, behind one data port: a worker's Pushes to both are frames on one
    connection (shared memory's calls, or ``-frames``: the bytes in them), and one shard's step waits for
    its peer's statistics, which need the Push behind it on that connection."""
    spec = SPLIT_SPECS[name.removesuffix("-frames")]
    shm = not name.endswith("-frames")
    w0, grads = _data([(65, 48), (6, 10, 12)], 40, seed=3)
    one, _ = on_servers(make_cluster(1).addresses, spec, w0, grads, shm=shm)
    two, smap = on_servers(make_cluster(2).addresses, spec, w0, grads, max_whole_bytes=0, shm=shm)
    for n in w0:
        assert smap.holders(n) == [0, 1]  # really split: one row block on each server
        torch.testing.assert_close(two[n], one[n], rtol=1e-5, atol=1e-6)


def test_split_statistics_need_a_barrier_mode(cluster2):
    w0, _ = _data([(16, 8)], 0)
    with shardps.connect(cluster2.addresses) as client:
        with pytest.raises(shardps.ShardError) as err:
            client.register(w0, optim.Adafactor(), sync="asp", max_whole_bytes=0)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'t0' uses adafactor" in err.value.details and "bsp or every:X" in err.value.details


def test_rules_pick_optimizers_per_tensor_and_stats_report_state_bytes(cluster2):
    rules = optim.Rules([("*.bias", optim.Adam()), (optim.min_rank(2), optim.Adafactor())], default=optim.SGD())
    tensors = {"fc.weight": torch.randn(256, 128), "fc.bias": torch.randn(128), "scale": torch.randn(4)}
    with shardps.connect(cluster2.addresses) as client:
        client.register(tensors, rules, sync="bsp")
        stats = {t["name"]: t for s in client.stats() for t in s["tensors"]}
    assert {n: t["optimizer"] for n, t in stats.items()} == {"fc.weight": "adafactor", "fc.bias": "adam",
                                                              "scale": "sgd"}
    assert stats["fc.weight"]["optimizer_state_bytes"] == (256 + 128) * 4 + 4  # factored: rows + columns + step
    assert stats["fc.bias"]["optimizer_state_bytes"] == 2 * 128 * 4 + 4
