"""shardps.nn.MoE: routing as the stated rules, the layer equal to a per-token dense loop, bsp as one process."""

from __future__ import annotations

import copy
import json
import math

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from torch import nn

import shardps
from shardps.optim import SGD
from shardps.protos.shardps.v1 import experts_pb2
from shardps.worker.experts.moe import MoECollector
from shardps.worker.experts.placement import AutoPlacement, CostModel
from shardps.worker.experts.routing import capacity, route
from tests.helpers import run_workers

D, E = 8, 8


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


def reference_keep(experts: list[list[int]], cap: int | None) -> list[list[bool]]:
    """The drop rule, written as a loop: first choices of every token in order, then second choices."""
    k = len(experts[0])
    keep = [[True] * k for _ in experts]
    taken = [0] * E
    for rank in range(k):
        for t, row in enumerate(experts):
            e = row[rank]
            keep[t][rank] = cap is None or taken[e] < cap
            taken[e] += 1
    return keep


def dense_loop(x: torch.Tensor, gate: nn.Module, experts: list[nn.Module], k: int, cap: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, list[list[bool]]]:
    """(out, E * sum f_i P_i, kept) by a loop over tokens and their routed experts."""
    h = x.reshape(-1, D)
    probs = F.softmax(gate(h), -1)
    top_p, top_i = torch.topk(probs, k, -1)
    w = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)
    keep = reference_keep(top_i.tolist(), cap)
    rows = []
    for t in range(h.shape[0]):
        y = torch.zeros(D)
        for r in range(k):
            if keep[t][r]:
                y = y + w[t, r] * experts[int(top_i[t, r])](h[t:t + 1])[0]
        rows.append(y)
    first = [sum(1 for t in range(h.shape[0]) if int(top_i[t, 0]) == i) / h.shape[0] for i in range(E)]
    aux = E * sum(first[i] * probs[:, i].mean() for i in range(E))
    return torch.stack(rows).view(x.shape), aux, keep


@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_drops_by_the_reference_rule_and_the_aux_loss_is_switchs(top_k):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(20, E, generator=g)
    logits[:, 0] += 2.0  # a popular expert: some of its tokens go over capacity
    probs = F.softmax(logits, -1)
    cap = capacity(20, E, top_k, 1.0, min_capacity=1)
    assert cap == math.ceil(top_k * 20 / E)
    r = route(probs, top_k, cap)
    want = reference_keep(r.expert.tolist(), cap)
    assert r.keep.tolist() == want
    assert r.dropped == sum(not k for row in want for k in row) > 0
    assert torch.equal(r.counts, torch.bincount(r.expert.reshape(-1), minlength=E))
    first = torch.bincount(probs.argmax(-1), minlength=E).float() / 20
    torch.testing.assert_close(r.aux, E * (first * probs.mean(0)).sum(), rtol=0, atol=1e-6)
    assert route(probs, top_k, None).dropped == 0  # dropless


@pytest.mark.parametrize("placement", ["pull", "send"])
@pytest.mark.parametrize("top_k,drop_tokens", [(1, False), (2, False), (2, True)])
def test_layer_equals_a_dense_loop_over_the_routed_experts(make_cluster, top_k, drop_tokens, placement):
    cluster = make_cluster(2)
    torch.manual_seed(top_k)
    moe = shardps.nn.MoE(D, E, expert, name="moe", top_k=top_k, capacity_factor=1.0, min_capacity=1,
                         drop_tokens=drop_tokens, aux_loss_coef=0.1, optimizer=SGD(lr=1.0), placement=placement)
    with torch.no_grad():
        moe.gate.weight[:, 0] += 3.0  # skewed: drops where they are on
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.0))
        before = client.pull_rows("moe", torch.arange(E), track=False)
        refs = [moe.expert_module(i) for i in range(E)]
        gate = copy.deepcopy(moe.gate)
        asked: list[int] = []
        for store in cluster.stores:  # the keys each server is asked for, counted where they arrive
            pull = store.rows.pull
            store.rows.pull = lambda name, dim, keys, pull=pull, **kw: (asked.extend(keys.tolist()),
                                                                        pull(name, dim, keys, **kw))[1]
        x = torch.randn(2, 3, D) + 1.0  # 6 tokens: fewer than the experts for top-1
        xr = x.clone().requires_grad_()
        x.requires_grad_()
        out, aux, counts = moe(x)
        pulled = sorted(asked)
        want, want_aux, kept = dense_loop(xr, gate, refs, top_k, moe.capacity(6))
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(aux, 0.1 * want_aux, rtol=0, atol=1e-6)
        assert moe.last is not None and moe.last.keep.tolist() == kept
        assert (moe.stats.dropped > 0) == drop_tokens
        assert moe.stats.placements[placement] == 1
        routed = sorted({int(e) for e, k in zip(moe.last.expert.reshape(-1), moe.last.keep.reshape(-1)) if k})
        assert pulled == routed and len(routed) < E  # only the experts routed, each once
        assert torch.equal(counts, torch.bincount(moe.last.expert.reshape(-1), minlength=E))
        weight = torch.randn(2, 3, D)
        ((out * weight).sum() + aux).backward()
        ((want * weight).sum() + 0.1 * want_aux).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(moe.gate.weight.grad, gate.weight.grad, rtol=0, atol=1e-6)
        opt.step()
        after = client.pull_rows("moe", torch.arange(E), track=False)
    for i in range(E):
        if i in routed:  # SGD(lr=1): the row moved by its gradient
            grad = torch.cat([p.grad.reshape(-1) for p in refs[i].parameters()])
            torch.testing.assert_close(before[i] - after[i], grad, rtol=0, atol=1e-6)
        else:  # no token: not pulled, not pushed, unchanged
            assert all(p.grad is None for p in refs[i].parameters())
            assert torch.equal(after[i], before[i])


STEPS, WORKERS, BATCH = 3, 2, 8


class Net(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, aux, _ = self.moe(x)
        return self.head(x + out).squeeze(-1), aux


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)


@pytest.mark.parametrize("placement", ["pull", "send"])
def test_bsp_two_workers_equal_one_process(cluster2, placement):
    def build() -> Net:
        torch.manual_seed(0)
        return Net(shardps.nn.MoE(D, E, expert, top_k=2, drop_tokens=False, optimizer=SGD(lr=0.5),
                                  placement=placement))

    models = [build() for _ in range(WORKERS)]

    def worker(k: int) -> torch.Tensor:
        model = models[k]
        with shardps.connect(cluster2.addresses, worker_id=k, num_workers=WORKERS) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.5), sync="bsp")
            for step in range(STEPS):
                x, y = data(step)
                mine = slice(k * BATCH // WORKERS, (k + 1) * BATCH // WORKERS)
                pred, aux = model(x[mine])
                (F.mse_loss(pred, y[mine]) + aux).backward()
                opt.step()
                opt.zero_grad()
            return torch.stack([model.moe.expert_module(i)[0].weight for i in range(E)]).detach()

    results = run_workers(worker, WORKERS)
    ref = build()
    experts = [copy.deepcopy(ref.moe.template[0]) for _ in range(E)]
    for e, row in zip(experts, ref.moe.experts.pretrained):
        torch.nn.utils.vector_to_parameters(row, e.parameters())
    params = [*ref.moe.gate.parameters(), *ref.head.parameters(), *(p for e in experts for p in e.parameters())]
    sgd = torch.optim.SGD(params, lr=0.5)
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        for k in range(WORKERS):  # each worker's loss on its half (aux is per batch), their mean
            mine = slice(k * BATCH // WORKERS, (k + 1) * BATCH // WORKERS)
            out, aux, _ = dense_loop(x[mine], ref.moe.gate, experts, 2, None)
            losses.append(F.mse_loss(ref.head(x[mine] + out).squeeze(-1), y[mine]) + 0.01 * aux)
        (sum(losses) / WORKERS).backward()
        sgd.step()
        sgd.zero_grad()
    want = torch.stack([e[0].weight for e in experts]).detach()
    for got in results:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert not torch.equal(got, torch.stack([r[0] for r in ref.moe.experts.pretrained.split(1)]))


def test_bad_input_and_metrics(make_cluster):
    cluster = make_cluster(1)
    torch.manual_seed(0)
    moe = shardps.nn.MoE(D, E, expert, name="m", capacity_factor=0.5, min_capacity=1)
    with pytest.raises(RuntimeError, match="DistributedOptimizer"):
        moe(torch.randn(4, D))
    with pytest.raises(ValueError, match="placement"):
        shardps.nn.MoE(D, E, expert, placement="far")
    with pytest.raises(ValueError, match="top_k"):
        shardps.nn.MoE(D, E, expert, top_k=E + 1)
    registry = CollectorRegistry()
    registry.register(MoECollector(nn.Sequential(moe)))
    with shardps.connect(cluster.addresses) as client:
        shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.1))
        before = client.pull_rows("m", torch.arange(E), track=False)
        with pytest.raises(ValueError, match=r"x must be \[\.\.\., 8\] \(d_model\), got \[4, 7\]"):
            moe(torch.randn(4, D - 1))
        assert moe.stats.tokens == 0
        out, _, counts = moe(torch.randn(4, 5, D))
        assert out.shape == (4, 5, D) and int(counts.sum()) == 20
        assert torch.equal(client.pull_rows("m", torch.arange(E), track=False), before)
    dropped = registry.get_sample_value("shardps_moe_dropped_total", {"layer": "0"})
    assert dropped == moe.stats.dropped == moe.last.dropped > 0
    assert registry.get_sample_value("shardps_moe_tokens_total", {"layer": "0"}) == 20


def test_auto_takes_the_placement_the_cost_model_says_is_faster_and_counts_it(make_cluster):
    cluster = make_cluster(1)
    torch.manual_seed(0)
    bytes_only = CostModel(byte_s=1e-9, pull_call_s=0.0, local_expert_s=0.0, local_flop_s=0.0, send_call_s=0.0,
                           server_expert_s=0.0, server_flop_s=0.0)  # the link alone decides
    moe = shardps.nn.MoE(D, E, expert, name="auto", placement="auto", drop_tokens=False, cost_model=bytes_only)
    registry = CollectorRegistry()
    registry.register(MoECollector(moe))
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.1))
        for tokens in (2, 256):  # few tokens: their bytes are fewer than the experts'; many: the reverse
            out, aux, _ = moe(torch.randn(tokens, D))
            assert moe.last is not None
            cost = moe.cost(moe.last)
            bytes_ = {"pull": 2 * len(moe.last.active()) * (4 * moe.experts.embedding_dim + 16),
                      "send": 5 * int(moe.last.keep.sum()) * D * 4}
            assert cost == pytest.approx({p: 1e-9 * b for p, b in bytes_.items()})
            want = "send" if cost["send"] < cost["pull"] else "pull"
            assert registry.get_sample_value("shardps_moe_forwards_total", {"layer": "moe", "placement": want}) == 1
            (out.sum() + aux).backward()
            opt.step()
            opt.zero_grad()
        assert moe.stats.placements == {"pull": 1, "send": 1}
        bad = experts_pb2.ExpertCall(table="auto", dim=moe.experts.embedding_dim, d_model=D,
                                     experts=np.array([1], "<u8").tobytes(), counts=np.array([2], "<i8").tobytes(),
                                     tokens=b"\0" * 4 * D)
        with pytest.raises(grpc.RpcError) as e:
            client.transport.experts(0).Forward(bad, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'auto': expected 2 tokens x 8 fp32 (64 bytes) of tokens, got 32" in e.value.details()


def test_auto_placement_tries_each_then_takes_the_faster_and_reprobes():
    auto = AutoPlacement(reprobe=4, probes=3, window=3)
    model_says_send = {"pull": 100.0, "send": 10.0}
    walk = []
    now = 0.0
    for i in range(10):
        auto.close(now)
        chosen = auto.choose(100, model_says_send)
        auto.start(100, chosen, now)
        # send takes 3 s a step, pull 1 s; the first pull is slowed to 9 s by other work on the machine
        now += {"pull": 9.0 if i == 1 else 1.0, "send": 3.0}[chosen]
        walk.append(chosen)
    # the model's choice (send), then each in turn until each has 3 times, then the faster by the median of
    # its last 3 (pull: the slowed step does not decide), every 4th step the slower once
    assert walk == ["send", "pull", "send", "pull", "send", "pull", "pull", "send", "pull", "pull"]
    b = auto.bucket(100)
    assert auto.samples[(b, "pull")] == [1.0, 1.0, 1.0] and auto.time(b, "send") == 3.0
    auto.close(now + 50.0, valid=False)  # an interval with an evaluation in it: not counted
    assert auto.time(b, "pull") == 1.0
    assert auto.choose(5000, model_says_send) == "send"  # another batch size: no times yet, the cost model decides


def test_cost_model_charges_each_placement_its_calls_experts_tokens_and_bytes():
    m = CostModel(byte_s=1.0, pull_call_s=10.0, local_expert_s=100.0, local_flop_s=1000.0, send_call_s=20.0,
                  server_expert_s=200.0, server_flop_s=2000.0)
    one = m.seconds(experts=1, assignments=0, params=3, d_model=2)  # an expert, no token: its row and its fixed part
    assert one == {"pull": 10.0 + 2 * (4 * 3 + 16) + 100.0, "send": 20.0 + 200.0}
    tok = m.seconds(experts=0, assignments=1, params=3, d_model=2)  # a token: 3 forwards here, or 4 there + bytes
    assert tok == {"pull": 10.0 + 3 * 6 * 1000.0, "send": 20.0 + 5 * 4 * 2 + 4 * 6 * 2000.0}
    sq = CostModel(**{**vars(m), "local_expert_sq_s": 3.0, "server_expert_sq_s": 5.0})  # and U^2 x each
    four = sq.seconds(experts=4, assignments=0, params=3, d_model=2)
    assert four == {"pull": 10.0 + 4 * (2 * (4 * 3 + 16) + 100.0) + 16 * 3.0, "send": 20.0 + 4 * 200.0 + 16 * 5.0}


def test_send_registers_the_program_again_where_a_shard_lost_it(make_cluster):
    cluster = make_cluster(2)
    torch.manual_seed(0)
    moe = shardps.nn.MoE(D, E, expert, name="lost", placement="send", drop_tokens=False, optimizer=SGD(lr=0.1))
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.1))
        before = client.pull_rows("lost", torch.arange(E), track=False)
        moe.experts.registered = True  # as after a restart from a checkpoint: the shards hold the rows, no program
        out, aux, _ = moe(torch.randn(16, D))
        (out.sum() + aux).backward()
        opt.step()
        after = client.pull_rows("lost", torch.arange(E), track=False)
    routed = moe.last.active() if moe.last is not None else torch.zeros(0)
    assert moe.stats.placements["send"] == 1 and len(routed) > 1
    assert all(not torch.equal(after[i], before[i]) for i in routed.tolist())


@pytest.mark.parametrize("placement, sync", [("send", "asp"), ("send", "ssp:1"), ("send", "every:2"),
                                             ("pull", "every:2")])
def test_the_experts_step_under_other_sync_modes(make_cluster, placement, sync):
    """"send": the backward puts the experts' gradients on the shards, so the table steps at every step();
    "pull" experts are a row table's rows: under every:2 their gradients are held and pushed once every 2
    step()s (docs/sparse.md), so each shard's table steps 2 times in 4 step()s, not 4."""
    cluster = make_cluster(2)
    torch.manual_seed(0)
    net = Net(shardps.nn.MoE(D, E, expert, name="s", placement=placement, drop_tokens=False, optimizer=SGD(lr=0.1)))
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(net, client, optimizer=SGD(lr=0.1), sync=sync)
        before = client.pull_rows("s", torch.arange(E), track=False)
        for step in range(4):
            x, y = data(step)
            pred, aux = net(x)
            (F.mse_loss(pred, y) + aux).backward()
            opt.step()
            opt.zero_grad()
            done = step + 1 if placement == "send" else (step + 1) // 2
            assert [s.rows.tables["s"].steps for s in cluster.stores] == [done] * 2  # every shard alike
        after = client.pull_rows("s", torch.arange(E), track=False)
    assert not torch.equal(after, before)


def test_row_calls_by_the_names_of_issue_24(make_cluster):
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses) as client:
        client.register_rows("t", 3, keys="int64", init={"kind": "zeros"}, optimizer=SGD(lr=1.0))
        keys = torch.tensor([5, 2**40, 5])
        assert torch.equal(client.pull_rows("t", keys), torch.zeros(3, 3))
        assert client.push_rows("t", keys, torch.ones(3, 3), step=1) == 2
        assert torch.equal(client.pull_rows("t", torch.tensor([5, 2**40])), -torch.tensor([[2.0] * 3, [1.0] * 3]))
        assert torch.equal(client.row_keys("t", ["a"]), client.rows.keys_of("t", ["a"]))


def test_demo_example_moe_trains(capsys):
    # The CLI in this process (no extra interpreter): 2 workers as threads, bsp, a tiny model for 4 steps.
    from shardps.cli import main

    assert main(["demo", "--example", "moe", "--workers", "2", "--steps", "4", "--eval-every", "4", "--dim", "16",
                 "--layers", "1", "--context", "16", "--batch-size", "8", "--placement", "auto", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["workers"] == 2 and summary["steps"] == 4
    assert summary["val_loss"] < summary["initial_val_loss"]
    assert sum(summary["placements"].values()) == 4 + 2 * 8  # a forward per step, 8 per evaluation


def test_auto_with_held_gradients_takes_one_placement_a_step(make_cluster):
    """``experts.hold`` (a pipeline stage's micro-batches): every forward of a step takes the placement of
    its first, and the steps still probe both; each step's gradients reach the rows either way."""
    cluster = make_cluster(1)
    torch.manual_seed(0)
    moe = shardps.nn.MoE(D, E, expert, name="held", placement="auto", drop_tokens=False, optimizer=SGD(lr=0.1))
    moe.experts.hold = True
    walk = []
    with shardps.connect(cluster.addresses) as client:
        opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.1))
        for _ in range(3):
            before = client.pull_rows("held", torch.arange(E), track=False)
            for _ in range(2):
                taken = dict(moe.stats.placements)
                out, aux, _ = moe(torch.randn(8, D))
                (out.sum() + aux).backward()
                walk.append(next(p for p in taken if moe.stats.placements[p] != taken[p]))
            opt.step()
            opt.zero_grad()
            assert not torch.equal(client.pull_rows("held", torch.arange(E), track=False), before)
    assert walk[0::2] == walk[1::2] and set(walk) == {"pull", "send"}


def test_a_worker_that_serves_metrics_serves_its_moe_layers_too(make_cluster):
    """``connect(metrics_port=0)``: the worker's own /metrics carries the model's MoE counters (by the
    layer's path) beside its step times, once however many optimizers the model gets; a model without MoE
    adds none."""
    import urllib.request

    cluster = make_cluster(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), shardps.nn.MoE(D, E, expert, name="served", drop_tokens=False))
    with shardps.connect(cluster.addresses, metrics_port=0) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.1))
        shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.1))  # the same model again: no error
        out, aux, _ = model[1](model[0](torch.randn(6, D)))
        (out.sum() + aux).backward()
        opt.step()
        assert client.metrics_endpoint is not None
        with urllib.request.urlopen(f"http://{client.metrics_endpoint.address}/metrics", timeout=30) as r:
            text = r.read().decode()
    assert 'shardps_moe_tokens_total{layer="1"} 6.0' in text
    assert 'shardps_moe_forwards_total{layer="1",placement="pull"} 1.0' in text
    assert "shardps_worker_steps_total" in text
    with shardps.connect(cluster.addresses, metrics_port=0) as client:
        shardps.DistributedOptimizer(nn.Linear(D, 2), client, optimizer=SGD(lr=0.1))
        assert client.metrics is not None and client.metrics.models == set()

