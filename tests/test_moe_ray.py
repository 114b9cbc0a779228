"""shardps.nn.MoE on a real Ray cluster.

In the stages of shardps.ray.Pipeline: each stage holds an MoE whose experts are rows on the servers; each
micro-batch's balancing loss joins its own backward; the experts' gradients are pushed at the step's end. Two
steps equal one process running the same model on the same micro-batches (a dense loop over the routed
experts, torch's SGD). And placement "send" on expert actors (shardps.ray.start_expert_actors) instead of the
shards: the layer equal to that dense loop, the actors having run every call.
"""

from __future__ import annotations

import copy
import math

import pytest
import ray
import torch
from torch import nn

import shardps
import shardps.ray as sray
from shardps.optim import SGD
from shardps.worker.experts.routing import capacity
from tests.test_moe import D, E, dense_loop, expert

pytestmark = pytest.mark.cluster

LR, COEF, STEPS, BATCH = 0.2, 0.1, 2, 12


class Block(nn.Module):
    """A residual MoE block: the stage hands on one tensor; the layer's balancing loss is not returned."""

    def __init__(self, name: str, top_k: int, placement: str) -> None:
        super().__init__()
        self.moe = shardps.nn.MoE(D, E, expert, name=name, top_k=top_k, aux_loss_coef=COEF, placement=placement,
                                  optimizer=SGD(lr=LR))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(x)
        return x + out


def build(placement: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, D), Block("moe_a", 2, placement), Block("moe_b", 1, placement),
                          nn.Linear(D, 4))
    with torch.no_grad():  # skewed routers: some experts get no token, some tokens go over capacity
        for i in (1, 2):
            model[i].moe.gate.weight[:2] += 1.0
    return model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


class OneProcess:
    """The same model in one process: its experts as local modules (their first values), torch's SGD."""

    def __init__(self, model: nn.Sequential) -> None:
        self.first, self.head = copy.deepcopy(model[0]), copy.deepcopy(model[3])
        self.blocks = [(copy.deepcopy(model[i].moe.gate), self._experts(model[i].moe), model[i].moe.top_k)
                       for i in (1, 2)]
        self.opt = torch.optim.SGD([p for m in self.modules() for p in m.parameters()], lr=LR)

    @staticmethod
    def _experts(moe: shardps.nn.MoE) -> list[nn.Module]:
        out = [copy.deepcopy(moe.template[0]) for _ in range(E)]
        for e, row in zip(out, moe.experts.pretrained):
            torch.nn.utils.vector_to_parameters(row, e.parameters())
        return out

    def modules(self) -> list[nn.Module]:
        return [self.first, self.head] + [m for gate, experts, _ in self.blocks for m in (gate, *experts)]

    def step(self, x: torch.Tensor, y: torch.Tensor, chunks: int) -> float:
        """Micro-batch by micro-batch: each's loss (cross-entropy + both balancing losses) weighs its share."""
        total = torch.zeros(())
        for xj, yj in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
            h, aux = self.first(xj), torch.zeros(())
            for gate, experts, k in self.blocks:
                out, a, _ = dense_loop(h, gate, experts, k, capacity(len(xj), E, k, 1.25, 4))
                h, aux = h + out, aux + COEF * a
            total = total + (nn.functional.cross_entropy(self.head(h), yj) + aux) * len(xj) / len(x)
        self.opt.zero_grad()
        total.backward()
        self.opt.step()
        return float(total.detach())


def expert_rows(addresses: list[str], name: str, like: shardps.nn.MoE) -> torch.Tensor:
    with shardps.connect(addresses) as client:
        client.register_rows(name, like.experts.embedding_dim, optimizer=SGD(lr=LR), init={"kind": "zeros"})
        return client.pull_rows(name, torch.arange(E), track=False)


@pytest.mark.parametrize("placement, chunks, schedule, checkpoint, replicas, sync", [
    ("pull", 3, "1f1b", "except_last", 1, "bsp"),  # kept forwards and recomputed ones, several micro-batches
    ("send", 3, "gpipe", "always", 1, "bsp"),  # the experts run on the shards, each micro-batch's gradients held
    ("auto", 3, "1f1b", "except_last", 1, "bsp"),  # one placement a step, for all its micro-batches
    # two replicas of the pipeline, each half the batch: each replica's stages push their expert rows as its
    # worker of two, held gradients too; the servers' mean is the one process's step on the 6 micro-batches
    ("send", 3, "1f1b", "except_last", 2, "bsp"),
    # asp: a stage with row modules pushes and pulls in the step (no overlap with the next step's forwards,
    # which pull rows of their own); with one replica each push is applied on arrival: one process's steps
    ("pull", 3, "1f1b", "except_last", 1, "asp"),
])
def test_moe_stages_train_as_one_process(ray_cluster, make_cluster, placement, chunks, schedule, checkpoint,
                                         replicas, sync):
    servers = make_cluster(2)
    model = build(placement)
    ref = OneProcess(model)
    with sray.Pipeline(model, balance=[2, 2], chunks=chunks, schedule=schedule, checkpoint=checkpoint,
                       servers=servers.addresses, optimizer=SGD(lr=LR), sync=sync, num_cpus=0.5,
                       replicas=replicas) as pipe:
        for step in range(STEPS):
            x, y = data(step)
            loss = pipe.train_step(x, y, nn.CrossEntropyLoss())
            assert loss == pytest.approx(ref.step(x, y, replicas * chunks), rel=1e-6)
        got = pipe.state_dict()
    want = {"0.weight": ref.first.weight, "0.bias": ref.first.bias, "3.weight": ref.head.weight,
            "3.bias": ref.head.bias, "1.moe.gate.weight": ref.blocks[0][0].weight,
            "2.moe.gate.weight": ref.blocks[1][0].weight}
    assert got.keys() == want.keys()
    for n, p in want.items():
        torch.testing.assert_close(got[n], p.detach(), rtol=0, atol=1e-6, msg=n)
    for i, name in ((1, "moe_a"), (2, "moe_b")):
        rows = expert_rows(servers.addresses, name, model[i].moe)
        experts = ref.blocks[i - 1][1]
        want_rows = torch.stack([torch.nn.utils.parameters_to_vector(e.parameters()) for e in experts]).detach()
        torch.testing.assert_close(rows, want_rows, rtol=0, atol=1e-6, msg=name)
        moved = (rows != model[i].moe.experts.pretrained).any(1)
        assert 0 < int(moved.sum()) < E  # some experts trained, and some got no token: untouched


def test_moe_stages_of_two_replicas_under_asp_apply_every_push_once(ray_cluster, make_cluster):
    """Under asp the result depends on the order the replicas' pushes arrive in: what is exact is that every
    push is applied once, on arrival (each of the 2 stages of the 2 replicas pushes its dense part every step:
    8 versions on each shard) and each expert table takes one step per replica per step (4), none a retry."""
    servers = make_cluster(2)
    with sray.Pipeline(build("send"), balance=[2, 2], chunks=3, schedule="1f1b", checkpoint="except_last",
                       servers=servers.addresses, optimizer=SGD(lr=LR), sync="asp", num_cpus=0.5,
                       replicas=2) as pipe:
        losses = [pipe.train_step(*data(step), nn.CrossEntropyLoss()) for step in range(STEPS)]
    assert all(math.isfinite(x) for x in losses)
    with shardps.connect(servers.addresses) as client:
        for st in client.stats():
            assert (st["version"], st["pushes_total"], st["gradients_applied_total"]) == (8, 8, 8), st["shard_index"]
            assert sorted((t["name"], t["steps"], t["duplicates"]) for t in st["row_tables"]) == \
                [("moe_a", 4, 0), ("moe_b", 4, 0)]


def test_a_pipeline_refuses_moe_stages_it_cannot_run(ray_cluster, make_cluster):
    model = build("auto")
    with pytest.raises(ValueError, match="needs servers="):
        sray.Pipeline(model, balance=[2, 2], chunks=1)
    servers = make_cluster(1).addresses
    with pytest.raises(ValueError, match=r"stage 0's MoE '1.moe' .* does not run with tensor_parallel"):
        sray.Pipeline(model, balance=[2, 2], chunks=1, servers=servers, tensor_parallel=2, tp_plan={"0": "column"})


def test_send_on_expert_actors_equals_a_dense_loop(ray_cluster, make_cluster):
    """One step of two forwards and backwards of top-2 "send" with the experts run by one actor per shard,
    each backward's gradients held on the actors (``hold``, as a pipeline stage's micro-batches): the
    outputs, the inputs' gradients and every expert's update (SGD, lr 1: the row moves by the sum of its
    gradients) equal a dense loop; the experts no token was routed to are unchanged; the actors answered
    every call, and each shard's table took one step."""
    cluster = make_cluster(2)
    with sray.start_expert_actors(cluster, num_cpus=0.5) as hosts:
        torch.manual_seed(2)
        moe = shardps.nn.MoE(D, E, expert, name="on_actors", top_k=2, drop_tokens=False, aux_loss_coef=0.1,
                             optimizer=SGD(lr=1.0), placement="send", expert_hosts=hosts)
        with torch.no_grad():
            moe.gate.weight[:, 0] += 3.0  # skewed: some experts get no token
        moe.experts.hold = True
        with shardps.connect(cluster.addresses) as client:
            opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.0))
            before = client.pull_rows("on_actors", torch.arange(E), track=False)
            refs = [moe.expert_module(i) for i in range(E)]
            gate = copy.deepcopy(moe.gate)
            routed: set[int] = set()
            for _ in range(2):  # two micro-batches, then one step
                x = torch.randn(2, 3, D) + 1.0
                xr = x.clone().requires_grad_()
                x.requires_grad_()
                out, aux, _ = moe(x)
                want, want_aux, _ = dense_loop(xr, gate, refs, 2, None)
                torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
                weight = torch.randn(2, 3, D)
                ((out * weight).sum() + aux).backward()
                ((want * weight).sum() + 0.1 * want_aux).backward()
                torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-6)
                assert moe.last is not None
                routed |= set(moe.last.active().tolist())
            opt.step()
            after = client.pull_rows("on_actors", torch.arange(E), track=False)
        calls = hosts.stats()
    assert 1 < len(routed) < E
    for i in range(E):
        if i in routed:
            grad = torch.cat([p.grad.reshape(-1) for p in refs[i].parameters()])
            torch.testing.assert_close(before[i] - after[i], grad, rtol=0, atol=1e-6)
        else:
            assert torch.equal(after[i], before[i])
    assert [c["Backward"] for c in calls] == [3, 3]  # two held, then the step's flush: every shard counts it
    assert sum(c["Forward"] for c in calls) >= 1 and all(c["RegisterExpert"] == 1 for c in calls)
    assert [s.rows.tables["on_actors"].steps for s in cluster.stores] == [1, 1]  # one table step on each shard


def test_an_expert_actor_killed_mid_step_is_restarted_and_the_step_is_exact(ray_cluster, make_cluster):
    """Two held backwards and a step on expert actors; shard 0's actor is killed (Ray restarts it) right after
    the first backward was held. The hold lives on the shard (``PushRows`` with ``hold``), not in the actor,
    so the restarted actor (its program registered again by the layer) pushes the step whole: every row
    equals the same step without the kill, bit for bit. Were the hold kept in the actor, the first
    backward's gradients would die with it."""
    rows, held = [], []
    for kill in (False, True):
        cluster = make_cluster(2)
        with sray.start_expert_actors(cluster, num_cpus=0.5) as hosts:
            torch.manual_seed(3)
            moe = shardps.nn.MoE(D, E, expert, name="restarted", drop_tokens=False, optimizer=SGD(lr=0.5),
                                 placement="send", expert_hosts=hosts)
            moe.experts.hold = True
            xs = [torch.randn(12, D) for _ in range(2)]
            with shardps.connect(cluster.addresses) as client:
                opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.0))
                before = client.pull_rows("restarted", torch.arange(E), track=False)
                for i, x in enumerate(xs):
                    out, aux, _ = moe(x)
                    (out.square().sum() + aux).backward()
                    if i == 0:
                        e = moe.experts
                        held.append(cluster.stores[0].rows.held.holds("restarted", e.rows.worker_id, e.sent_step))
                        if kill:
                            ray.kill(hosts.actors[0], no_restart=False)
                opt.step()
                rows.append(client.pull_rows("restarted", torch.arange(E), track=False))
            calls = hosts.stats()
        assert [s.rows.tables["restarted"].steps for s in cluster.stores] == [1, 1]
        if kill:  # the restarted actor: the program again, the second backward and the step's flush
            assert calls[0]["RegisterExpert"] == 1 and calls[0]["Backward"] == 2
    assert held == [True, True]
    assert (rows[0] != before).any(dim=1).sum() >= 2
    assert torch.equal(rows[0], rows[1])
