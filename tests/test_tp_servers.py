"""Tensor parallelism through the parameter servers: each TP rank a worker pushing and pulling its slices.

Real gRPC servers on loopback (in this process), the TP ranks threads with gloo groups (tests/test_tp.py's
``run_tp``): 20 Adam steps at TP = 2 equal 20 steps of the unsplit model; a checkpoint written at TP = 2
resumes at TP = 4 and at TP = 1, bit for bit on the master weights; a pipeline of 2 stages x TP 2 equals
the unsplit model too.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import shardps
import shardps.tp as tp
from shardps.examples import shakespeare as gpt
from shardps.worker.tp.split import join_slices
from tests.helpers import run_workers
from tests.test_tp import _RNG, run_tp

pytestmark = pytest.mark.cluster

VOCAB, DIM, LAYERS, CONTEXT = 13, 16, 1, 8
# eps 1e-3, not 1e-8: the key projection's bias has a gradient of zero but for rounding (softmax does not
# change when every score of a row moves alike), and Adam with a tiny eps turns that rounding's sign into
# steps of the full learning rate, in the unsplit model as in the split one; everything else is as default.
ADAM = shardps.optim.Adam(lr=1e-2, eps=1e-3)


def _model():
    return gpt.make_model(VOCAB, dim=DIM, heads=4, layers=LAYERS, context=CONTEXT, seed=4)


def _batch(step: int, replica: int = 0, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(VOCAB, (4, CONTEXT), generator=g)
    y = torch.randint(VOCAB, (4, CONTEXT), generator=g)
    per = 4 // replicas
    return x[replica * per:(replica + 1) * per], y[replica * per:(replica + 1) * per]


def _train_tp(addresses, p: int, replicas: int, steps: range, resume: bool = False):
    """``replicas`` data-parallel TP groups of ``p`` ranks (worker ``r * p + t``); each rank's dense state
    and the names it owns. ``resume``: no rank offers its values (the servers' restored ones stay)."""

    def replica(r: int):
        def rank(t: int, group: tp.TPGroup):
            with _RNG:  # the ranks are threads: one default random stream, seeded and drawn one rank at a time
                dense = _model()
            m = tp.split(dense, gpt.tp_plan(LAYERS), group)
            loss_fn = gpt.TPCharLoss(VOCAB, group)
            with shardps.connect(addresses, worker_id=r * p + t, num_workers=replicas * p) as client:
                opt = tp.TPOptimizer(m, client, group, optimizer=ADAM, sync="bsp",
                                     provides_values=False if resume else None)
                for step in steps:
                    x, y = _batch(step, r, replicas)
                    loss_fn(m(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                return tp.gather(m, group), opt.owned
        return run_tp(p, rank, timeout=60)
    return [res for rep in run_workers(replica, replicas, timeout=90) for res in rep]


def _reference(model, addresses, steps: int = 20):
    """``model`` unsplit, trained ``steps`` steps through the servers at ``addresses`` by one worker."""
    with shardps.connect(addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=ADAM, sync="bsp")
        for step in range(steps):
            x, y = _batch(step)
            gpt.CharLoss()(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return model


def test_20_adam_steps_at_tp2_equal_the_unsplit_model_and_each_tensor_has_one_owner(make_cluster):
    ref = _reference(_model(), make_cluster(2).addresses)
    results = _train_tp(make_cluster(2).addresses, 2, 1, range(20))
    want = ref.state_dict()
    for state, _ in results:
        for n, t in want.items():
            torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        assert not torch.equal(state["1.mlp.0.weight"], _model().state_dict()["1.mlp.0.weight"])  # it trained
    owned = [names for _, names in results]  # whose values each rank registered (replica 0's)
    assert sorted(owned[0] + owned[1]) == sorted(want)  # every tensor once per TP group: split or replicated
    assert owned[0] and owned[1]


def test_a_checkpoint_written_at_tp2_resumes_at_tp4_and_tp1(make_cluster, tmp_path):
    # The job keeps its number of workers (4): 2 replicas x TP 2, then 1 x TP 4, then 4 x TP 1.
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path / "a"))
    trained = _train_tp(cluster.addresses, 2, 2, range(3))[0][0]
    with shardps.connect(cluster.addresses) as client:
        assert [v for v, _ in client.checkpoint()] == [3, 3]
    cluster.stop()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    after: dict[int, dict[str, torch.Tensor]] = {}
    for p, replicas, folder in ((4, 1, "a"), (1, 4, "b")):
        again = make_cluster(2, checkpoint_dir=str(tmp_path / folder))
        with shardps.connect(again.addresses) as client:
            client.attach()
            assert client.recover() == 3
            masters = client.pull()
        for n, t in trained.items():
            assert torch.equal(masters[n], t), n  # the servers' masters: the TP = 2 model, bit for bit
        results = _train_tp(again.addresses, p, replicas, range(3, 5), resume=True)
        after[p] = results[0][0]
        again.stop()
    for n, t in after[4].items():  # two more steps from the checkpoint: the same at TP = 4 and TP = 1
        torch.testing.assert_close(t, after[1][n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_20_adam_steps_of_2_stages_x_tp2_equal_the_unsplit_model(make_cluster):
    """PP 2 x TP 2 without Ray: the four stage actors' own class run as threads (each its stage's TP rank,
    its pipeline group per TP rank, its TP group per stage, from one rendezvous store), the servers in
    this process; 20 steps equal the unsplit model's 20 (tests/test_tp_ray.py does it on Ray, 3 steps)."""
    from shardps.deploy.ray.stage_actor import StageActor, StageOptions
    from shardps.protos.syncspec import SyncSpec
    from shardps.worker.groups import RendezvousServer
    from shardps.worker.pipeline.partition import scatter, split_model
    from shardps.worker.pipeline.plan import plan_step

    layers = 2
    model = gpt.make_model(VOCAB, dim=DIM, heads=4, layers=layers, context=CONTEXT, seed=4)
    ref = _reference(copy.deepcopy(model), make_cluster(2).addresses)
    cluster = make_cluster(2)
    opts = StageOptions(servers=tuple(cluster.addresses), sync=SyncSpec("bsp"), optimizer=ADAM,
                        tensor_parallel=2, tp_plan=gpt.tp_plan(layers))
    stages = split_model(model, [2, 2])
    keys = [(s, t) for s in range(2) for t in range(2)]
    actors = {(s, t): StageActor(copy.deepcopy(stages[s]), s, 2, 0, opts, t) for s, t in keys}
    rendezvous = RendezvousServer("127.0.0.1", timeout=60)
    try:
        run_workers(lambda k: actors[keys[k]].connect(rendezvous.address, f"pp/r0/t{keys[k][1]}/g1", 60,
                                                      f"tp/r0/s{keys[k][0]}/g1"), 4, timeout=90)
        for step in range(20):
            x, y = _batch(step)
            xs, ys = scatter(x, 2), scatter(y, 2)
            plan = plan_step("1f1b", [len(c) for c in xs], 2, "mean")
            def run(k, step=step, plan=plan, xs=xs, ys=ys):
                first, last = keys[k][0] == 0, keys[k][0] == 1
                return actors[keys[k]].run_step(step, plan, xs if first else None, ys if last else None,
                                                gpt.TPCharLoss(VOCAB) if last else None, 60)

            losses = run_workers(run, 4, timeout=90)
            assert sum(losses[keys.index((1, 0))]) == pytest.approx(sum(losses[keys.index((1, 1))]), rel=1e-6)
        states = {key: a.state_dict() for key, a in actors.items()}
        slices = {key: a.tp_slices() for key, a in actors.items()}
    finally:
        for a in actors.values():
            a.close()
        rendezvous.close()
    want = ref.state_dict()
    for s in range(2):
        for n, t in states[(s, 0)].items():
            split = slices[(s, 0)].get(n)
            got = join_slices([states[(s, r)][n] for r in range(2)], *split) if split else t
            torch.testing.assert_close(got, want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
