"""Each TP rank pushes and pulls its own slices: the bytes it sends and receives are its slice's, counted.

Real gRPC servers on loopback, the TP ranks threads with gloo groups (tests/test_tp.py's ``run_tp``). Each
rank's Push messages and Pull responses are counted as they go (their chunks' data, per tensor): a split
parameter's bytes are the rank's slice's both ways (the column-split ``mlp.0`` along dim 0, the row-split
``mlp.2`` along dim 1, attention's q/k/v and output projection), a replicated one's the whole tensor's,
pushed by one rank of the group (its owner) and pulled by every rank, and the shards' own counts of the
bytes they served and were pushed equal the ranks' sums. The model trained so equals the unsplit one (the
exactness tests in tests/test_tp_servers.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import shardps
import shardps.tp as tp
from shardps.examples import shakespeare as gpt
from shardps.testing.wire import count_wire
from tests.test_tp import _RNG, run_tp
from tests.test_tp_servers import ADAM, LAYERS, VOCAB, _batch, _model

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("p", [2, 4])
def test_each_rank_receives_its_slices_and_the_replicated_tensors_whole(make_cluster, monkeypatch, p: int) -> None:
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1) as probe:
        served_before = sum(s["pull_bytes_total"] for s in probe.stats())
        pushed_before = sum(s["push_bytes_total"] for s in probe.stats())

    def rank(t: int, group: tp.TPGroup):
        with _RNG:
            dense = _model()
        whole = {n: tuple(w.shape) for n, w in dense.named_parameters()}
        m = tp.split(dense, gpt.tp_plan(LAYERS), group)
        loss_fn = gpt.TPCharLoss(VOCAB, group)
        with shardps.connect(cluster.addresses, worker_id=t, num_workers=p, part_bytes=256,
                             shm=False) as client:
            opt = tp.TPOptimizer(m, client, group, optimizer=ADAM, sync="bsp")
            assert all(w.device.type == "meta" for w in opt.opt.params.values())  # no whole tensor kept
            seen, sent = count_wire(client)
            x, y = _batch(0)
            loss_fn(m(x), y).backward()
            opt.step()  # the pull after the push: what this test counts
            opt.zero_grad()
            held = {n: w.numel() for n, w in m.named_parameters()}
            return (seen, held, whole, tp.tp_slices(m), {n: w.detach().clone() for n, w in m.named_parameters()},
                    sent)

    results = run_tp(p, rank, timeout=60)
    total = total_sent = 0
    pushers: Counter[str] = Counter()
    for t, (seen, held, whole, split, _, sent) in enumerate(results):
        assert set(seen) == set(held)  # every parameter came down, nothing else
        for n, k in held.items():
            numel = torch.Size(whole[n]).numel()
            if n in split:
                assert seen[n] == k * 4, (t, n)  # fp32: the slice's elements, nothing of the others'
                assert sent[n] == k * 4, (t, n)  # and its slice of the gradient went up
                assert k < numel or numel == 0
            else:
                assert seen[n] == numel * 4, (t, n)
                assert sent[n] in (0, numel * 4), (t, n)  # a replicated gradient: whole, or not at all
                pushers[n] += sent[n] > 0
        assert set(sent) <= set(held) | {""}  # "": the last message, without a chunk
        total += sum(seen.values())
        total_sent += sum(sent.values())
    assert all(pushers[n] == 1 for n in pushers) and pushers  # each replicated gradient once per TP group
    # The dim-1 slices (the row-split mlp.2 and attention's output projection) came without whole rows.
    assert {"1.mlp.2.weight", "1.proj.weight"} <= set(results[0][3])
    assert all(results[0][3][n][0].dim == 1 for n in ("1.mlp.2.weight", "1.proj.weight"))
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1) as probe:
        stats = probe.stats()
        served = sum(s["pull_bytes_total"] for s in stats) - served_before
        # The shards served the init pulls (the same bytes) and the step's: twice what the step's counted.
        assert served == 2 * total
        assert sum(s["push_bytes_total"] for s in stats) - pushed_before == total_sent
        # The ranks' slices join into the servers' whole tensors.
        probe.attach()
        for n, (sl, shape) in results[0][3].items():
            full = torch.empty(shape)
            for t in range(p):
                sl.put(full, results[t][4][n], p, t)
            assert torch.equal(probe.pull([n])[n], full), n


def test_compression_is_refused_with_tp(make_cluster) -> None:
    from shardps.compress import TopK

    with _RNG:
        m = tp.split(_model(), gpt.tp_plan(LAYERS), tp.TPGroup.single())
    with shardps.connect(make_cluster(1).addresses) as client:
        with pytest.raises(ValueError, match="compress= is not supported: a TP rank pushes its slices"):
            tp.TPOptimizer(m, client, optimizer=ADAM, compress=TopK(0.05))


def test_a_rejoin_registers_shapes_only_and_pulls_the_slices_again(make_cluster) -> None:
    """What ``_push_failed`` does on REJOIN (``_join``): the whole model registered without values, then each
    rank's slices pulled again; training goes on."""
    cluster = make_cluster(2)

    def rank(t: int, group: tp.TPGroup):
        with _RNG:
            m = tp.split(_model(), gpt.tp_plan(LAYERS), group)
        loss_fn = gpt.TPCharLoss(VOCAB, group)
        with shardps.connect(cluster.addresses, worker_id=t, num_workers=2, part_bytes=256) as client:
            opt = tp.TPOptimizer(m, client, group, optimizer=ADAM, sync="bsp")
            for step in range(3):
                x, y = _batch(step)
                loss_fn(m(x), y).backward()
                opt.step()
                opt.zero_grad()
                if step == 1:
                    held = {n: w.detach().clone() for n, w in m.named_parameters()}
                    with torch.no_grad():
                        for w in m.parameters():
                            w.zero_()
                    opt.opt._join()
                    assert all(torch.equal(w, held[n]) for n, w in m.named_parameters())
            return opt.opt.rejoins, opt.opt.pushes, tp.gather(m, group)

    results = run_tp(2, rank, timeout=60)
    assert [(r, p) for r, p, _ in results] == [(0, 3), (0, 3)]
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1) as probe:
        probe.attach()
        pulled = probe.pull()
    assert all(torch.equal(results[0][2][n], w) for n, w in pulled.items())
