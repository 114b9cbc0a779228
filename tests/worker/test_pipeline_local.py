"""The pipeline is transparent: its gradients are one process's (the stages run in this process here;
tests/test_pipeline_ray.py runs them as Ray actors)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from shardps.worker.pipeline.local import LocalPipeline, reference_step
from shardps.worker.pipeline.offload import LocalSink
from shardps.worker.pipeline.partition import BalanceError
from shardps.worker.pipeline.stage import StageRuntime

BALANCE = {1: [7], 2: [3, 4], 4: [2, 2, 2, 1]}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def data(n: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def one_process(model, x, y, loss_fn):
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def assert_grads(got, expected):
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("d, chunks, schedule, checkpoint", list(itertools.product(
    (1, 2, 4), (1, 3, 8), ("gpipe", "1f1b"), ("always", "except_last", "never"))))
def test_gradients_equal_one_process(d, chunks, schedule, checkpoint):
    model, (x, y) = mlp(), data(10)  # 10 samples: 3 and 8 do not divide it
    loss_fn = nn.CrossEntropyLoss()
    pipe = LocalPipeline(model, balance=BALANCE[d], chunks=chunks, schedule=schedule, checkpoint=checkpoint)
    loss = pipe.train_step(x, y, loss_fn)
    ref_loss, ref = one_process(model, x, y, loss_fn)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads(pipe.gradients(), ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sum_and_mean_losses(reduction, schedule):
    model, (x, y) = mlp(), data(11)
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    pipe = LocalPipeline(model, balance=[3, 4], chunks=4, schedule=schedule)
    loss = pipe.train_step(x, y, loss_fn)
    ref_loss, ref = one_process(model, x, y, loss_fn)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads(pipe.gradients(), ref)
    mse = lambda out, t: nn.functional.mse_loss(out, nn.functional.one_hot(t, 4).float(), reduction="sum")  # noqa: E731
    pipe.train_step(x, y, mse, reduction="sum")  # a plain function: the reduction is said
    _, ref = one_process(model, x, y, mse)
    assert_grads(pipe.gradients(), ref)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_with_the_same_random_streams(schedule, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.Dropout(0.3),
                          nn.Linear(32, 4))
    x, y = data(12)
    pipe = LocalPipeline(model, balance=[3, 3], chunks=3, schedule=schedule, checkpoint=checkpoint, seed=7)
    loss = pipe.train_step(x, y, nn.CrossEntropyLoss())
    ref = copy.deepcopy(model)
    ref_loss = reference_step(ref, [3, 3], x, y, nn.CrossEntropyLoss(), 3, seed=7)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads(pipe.gradients(), {n: p.grad for n, p in ref.named_parameters()})
    # and the masks were random: another seed gives other gradients
    other = LocalPipeline(model, balance=[3, 3], chunks=3, schedule=schedule, checkpoint=checkpoint, seed=8)
    other.train_step(x, y, nn.CrossEntropyLoss())
    assert not torch.equal(other.gradients()["0.weight"], pipe.gradients()["0.weight"])


def test_layernorm_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16),
                          nn.Linear(16, 4))
    x, y = data(9)
    for schedule in ("gpipe", "1f1b"):
        pipe = LocalPipeline(model, balance=[2, 2, 2], chunks=3, schedule=schedule)
        pipe.train_step(x, y, nn.CrossEntropyLoss())
        assert_grads(pipe.gradients(), one_process(model, x, y, nn.CrossEntropyLoss())[1])


def test_a_weight_tied_within_a_stage_and_a_module_with_buffers():
    """A stage runs its forward on the installed tensors under every name a parameter has (two Linears
    sharing one weight: its gradient sums both uses, under the one name named_parameters gives it), and on
    the module's own buffers (BatchNorm's running statistics move as in one process)."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second, nn.BatchNorm1d(8), nn.Linear(8, 4))
    x, y = data(12)
    pipe = LocalPipeline(model, balance=[3, 2], chunks=1, checkpoint="never")
    pipe.train_step(x, y, nn.CrossEntropyLoss())
    ref = copy.deepcopy(model)
    _, grads = one_process(ref, x, y, nn.CrossEntropyLoss())
    assert "2.weight" not in grads  # tied: one name
    assert_grads(pipe.gradients(), grads)
    ref.train()
    ref(x)
    bn = pipe.stages[1].module[0]
    torch.testing.assert_close(bn.running_mean, ref[3].running_mean)
    assert all(isinstance(p, nn.Parameter) for p in bn.parameters())  # its own parameters back after the call


def test_a_list_of_stages_keeps_the_names_sequential_gives_them():
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4)]
    x, y = data(6)
    pipe = LocalPipeline(stages, balance=None, chunks=2)
    pipe.train_step(x, y, nn.CrossEntropyLoss())
    assert_grads(pipe.gradients(), one_process(nn.Sequential(*stages), x, y, nn.CrossEntropyLoss())[1])
    assert sorted(pipe.state_dict()) == ["0.0.bias", "0.0.weight", "1.bias", "1.weight"]


@pytest.mark.parametrize("compress", [None, "relu-mask"])
def test_offloaded_activations_give_the_same_gradients(compress):
    model, (x, y) = mlp(), data(10)
    pipe = LocalPipeline(model, balance=[3, 4], chunks=3, checkpoint="never", offload="activations",
                         compress=compress)
    pipe.train_step(x, y, nn.CrossEntropyLoss())
    assert_grads(pipe.gradients(), one_process(model, x, y, nn.CrossEntropyLoss())[1])
    assert all(not s.data for s in pipe.sinks)  # every offloaded tensor was fetched back and dropped


def test_bf16_offload_is_close_but_not_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    pipe = LocalPipeline(model, balance=[2, 3], chunks=2, checkpoint="never", offload="activations", compress="bf16")
    pipe.train_step(x, y, nn.CrossEntropyLoss())
    ref = one_process(model, x, y, nn.CrossEntropyLoss())[1]
    got = pipe.gradients()
    rel = max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
    assert 0 < rel < 2e-2, rel  # bf16 keeps 8 bits of mantissa: about 0.4% per value


def test_bad_input_is_refused_before_anything_runs():
    model = mlp()
    with pytest.raises(BalanceError, match=r"module and sum of balance have different length \(module: 7, "
                                           r"sum of balance: 6\)"):
        LocalPipeline(model, balance=[3, 3], chunks=2)
    with pytest.raises(ValueError, match="chunks must be a positive integer, got 0"):
        LocalPipeline(model, balance=[3, 4], chunks=0)
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        LocalPipeline(model, balance=[3, 4], chunks=2, checkpoint="sometimes")
    pipe = LocalPipeline(model, balance=[3, 4], chunks=4)
    with pytest.raises(ValueError, match="batch of 3 samples cannot be cut into 4 micro-batches"):
        pipe.train_step(*data(3), nn.CrossEntropyLoss())

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    bad = LocalPipeline(nn.Sequential(nn.Linear(8, 8), Pair(), nn.Linear(8, 4)), balance=[2, 1], chunks=2)
    with pytest.raises(TypeError, match="stage 0 returned tuple, not a tensor"):
        bad.train_step(*data(4), nn.CrossEntropyLoss())


def test_a_backward_runs_on_the_weights_its_forward_used():
    """Weight stashing: new weights installed between a micro-batch's forward and its backward do not
    reach that backward (nor its recomputation)."""
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        st = StageRuntime(copy.deepcopy(module), 0, 1, checkpoint=checkpoint, loss_fn=nn.MSELoss(reduction="sum"))
        st.begin_step(0, 2)
        x, t = torch.randn(2, 4), torch.randn(2, 2)
        st.forward(0, x[:1])
        new = {n: p.detach() + 1.0 for n, p in module.named_parameters()}
        st.install(new)
        st.forward(1, x[1:])
        st.backward(0, target=t[:1])
        st.backward(1, target=t[1:])
        assert st.versions == [(0, 0, 0, 0), (0, 1, 1, 1)]
        old_model, new_model = copy.deepcopy(module), copy.deepcopy(module)
        with torch.no_grad():
            for n, p in new_model.named_parameters():
                p.copy_(new[n])
        nn.MSELoss(reduction="sum")(old_model(x[:1]), t[:1]).backward()
        nn.MSELoss(reduction="sum")(new_model(x[1:]), t[1:]).backward()
        expected = {n: p.grad + dict(new_model.named_parameters())[n].grad for n, p in old_model.named_parameters()}
        assert_grads(st.gradients(), expected)


def test_offload_moves_the_saved_activations_out_of_the_stage():
    torch.manual_seed(0)
    # ReLU -> Dropout: the ReLU's output feeds only the ReLU's backward (the Linear after saves the dropout's
    # output): what the 1-bit mask replaces.
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(512, 4))
    x, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
    held, stored = {}, {}
    for mode, kw in {"off": {}, "on": {"offload": "activations"},
                     "relu-mask": {"offload": "activations", "compress": "relu-mask"},
                     "bf16+relu-mask": {"offload": "activations", "compress": ("bf16", "relu-mask")}}.items():
        pipe = LocalPipeline(model, balance=[7], chunks=4, checkpoint="never", **kw)
        pipe.train_step(x, y, nn.CrossEntropyLoss())
        s = pipe.stages[0].offloader.stats
        held[mode], stored[mode] = s.peak_held_bytes, s.stored_total
    assert held["on"] < held["off"] / 10  # what stays: the saved tensors too small to send
    assert stored["relu-mask"] < stored["on"] and stored["bf16+relu-mask"] < stored["relu-mask"]


def test_stages_that_share_one_offload_store_keep_their_tensors_apart():
    """Found on Ray: every stage numbered its keys from 0, and in the one store of a pipeline the second
    stage's activations overwrote the first's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    x, y = torch.randn(30, 8), torch.randint(0, 4, (30,))
    pipe = LocalPipeline(model, balance=[2, 3], chunks=3, checkpoint="never", offload="activations")
    shared = LocalSink()
    for st in pipe.stages:
        st.offload = st.offloader.sink = shared
    pipe.train_step(x, y, nn.CrossEntropyLoss())
    assert_grads(pipe.gradients(), one_process(model, x, y, nn.CrossEntropyLoss())[1])
    assert pipe.stages[0].offloader.stats.stored_total > 0 and pipe.stages[1].offloader.stats.stored_total > 0


def test_offload_recognises_a_tensor_saved_twice_by_its_memory_only_while_it_lives():
    """Found by benchmarks/pipeline_offload.py: stored tensors were recognised by their memory alone; a
    freed activation's memory, reused by the next one of the same shape, returned the old one's values."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 512)]
    for _ in range(4):
        layers += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512)]
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(512, 10))
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    kept = LocalPipeline(model, balance=[len(model)], chunks=2, checkpoint="never", seed=3)
    kept.train_step(x, y, nn.CrossEntropyLoss())
    for compress in (None, "relu-mask"):
        off = LocalPipeline(model, balance=[len(model)], chunks=2, checkpoint="never", seed=3, offload="activations",
                            compress=compress)
        off.train_step(x, y, nn.CrossEntropyLoss())
        assert_grads(off.gradients(), kept.gradients())


def test_the_char_gpt_cut_in_stages_is_transparent():
    """The shakespeare example's model (attention, LayerNorm, residuals) through the pipeline."""
    from shardps.examples.shakespeare import CharLoss, make_model

    model = make_model(65, dim=32, heads=4, layers=2, context=16)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 65, (6, 16), generator=g), torch.randint(0, 65, (6, 16), generator=g)
    for schedule in ("gpipe", "1f1b"):
        pipe = LocalPipeline(model, balance=[2, 2], chunks=3, schedule=schedule)
        loss = pipe.train_step(x, y, CharLoss())
        ref_loss, ref = one_process(model, x, y, CharLoss())
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads(pipe.gradients(), ref)


@pytest.mark.parametrize("link", ["mailbox", "gloo"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_walking_its_own_part_in_a_thread_is_transparent(schedule, link):
    """The plan and walker run per stage (each stage its own tasks, activations handed to the neighbour
    through a Mailbox, or over a gloo group as on Ray): the gradients are still one process's."""
    from shardps.worker.pipeline.partition import scatter
    from shardps.worker.pipeline.plan import plan_step
    from shardps.worker.pipeline.walk import Mailbox, walk
    from tests.worker.test_link import in_threads, links

    model, (x, y) = mlp(), data(10)
    pipe = LocalPipeline(model, balance=[2, 2, 2, 1], chunks=3, schedule=schedule, checkpoint="never")
    xs, ys = scatter(x, 3), scatter(y, 3)
    plan = plan_step(schedule, [len(c) for c in xs], 4, "mean")
    box: Mailbox[torch.Tensor] = Mailbox(timeout=60)
    per_stage = links(4) if link == "gloo" else [box] * 4
    for st in pipe.stages:
        st.loss_fn = nn.CrossEntropyLoss()
        st.begin_step(0, 3)

    def run(s: int) -> list[float]:
        lk = per_stage[s]
        if link == "gloo":
            lk.start(0, 60, plan.orders)
        out = walk(plan, {s: pipe.stages[s]}, lk, xs if s == 0 else None, ys if s == 3 else None)
        if link == "gloo":
            lk.flush()
        return out

    losses = in_threads(4, run)
    ref_loss, ref = one_process(model, x, y, nn.CrossEntropyLoss())
    assert sum(losses[3]) == pytest.approx(ref_loss, rel=1e-5)
    assert_grads(pipe.gradients(), ref)
