"""What ``shardps.tp.split`` keeps of a model it did not write: ties, a subclass's work, partial gradients,
embedding options, and the groups a torch user already has.

Regressions pinned: a weight tied between an embedding and the output head became two ``Parameter``s after a
split (even at TP 1), so the embedding's gradient missed the head's part, silently; a ``ProcessGroup`` failed
deep inside (``unsupported operand type(s) for /: 'int' and 'method'``); a subclass of ``nn.Linear`` whose
``forward`` scales its output was replaced by the plain parallel layer, losing the scale; an embedding's
``padding_idx`` row got a gradient once split. Ranks are threads with gloo groups (tests/test_tp.py).
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardps.tp as tp
from tests.helpers import run_workers
from tests.test_tp import _close, gloo_once_more, run_tp

VOCAB, DIM = 13, 8


class TiedLM(nn.Module):
    """An embedding, one hidden layer and a head whose weight is the embedding's (as language models ship)."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.down(F.gelu(self.up(h))))


PLAN = {"embed": "vocab", "up": "column", "down": "row", "head": "column_gather"}
IDS = torch.tensor([[1, 4, 12, 0, 7], [3, 3, 9, 11, 2]])


def _dense(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    m = copy.deepcopy(model)
    loss = F.cross_entropy(m(IDS).flatten(0, 1), IDS.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_a_tie_stays_one_parameter_without_a_group():
    model = tp.split(TiedLM(), PLAN)  # TP 1
    assert model.head.weight is model.embed.weight
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in TiedLM().named_parameters()]


@pytest.mark.parametrize("p", [2, 3])
def test_a_tied_weight_split_equals_the_dense_model(p):
    model = TiedLM()
    want_loss, want = _dense(model)

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), PLAN, group)
        assert m.head.weight is m.embed.weight  # one slice object for both users
        loss = F.cross_entropy(m(IDS).flatten(0, 1), IDS.flatten())
        loss.backward()
        return loss.item(), tp.gather_grads(m, group), tp.gather(m, group), tp.tp_slices(m)

    for k, (loss, grads, state, slices) in enumerate(run_tp(p, rank)):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert grads.keys() == want.keys()  # the tie under its first name only, as the dense model names it
        for n in want:
            _close(grads[n], want[n], f"rank {k} grad {n}")  # embed.weight: the embedding's part and the head's
        assert torch.equal(state["head.weight"], model.embed.weight) and state.keys() == model.state_dict().keys()
        assert "embed.weight" in slices and "head.weight" not in slices  # one tensor, under its first name


def test_a_tie_cut_two_ways_is_refused_naming_both_users_and_changes_nothing():
    model = TiedLM()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"embed.weight and head.weight are one tensor \(tied weights\); 'vocab' on "
                                         r"embed cuts it along dim 0, 'row' on head along dim 1"):
        tp.split(model, {**PLAN, "head": "row"}, tp.TPGroup(None, 0, 2))
    with pytest.raises(ValueError, match=r"'vocab' on embed cuts it along dim 0, 'not split' on head not at all"):
        tp.split(model, {"embed": "vocab"}, tp.TPGroup(None, 0, 2))
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert model.head.weight is model.embed.weight


def test_a_torch_process_group_is_a_tp_group():
    model = TiedLM()
    want_loss, want = _dense(model)
    def rank(k: int, store):
        prefixed = dist.PrefixStore("pg", store)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        backend = dist.ProcessGroupGloo(prefixed, k, 2, opts)
        pg = dist.ProcessGroup(prefixed, k, 2)  # what new_group() returns after init_process_group
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        m = tp.split(copy.deepcopy(model), PLAN, pg)
        assert m.up.group.size == 2 and m.up.group.rank == k
        loss = F.cross_entropy(m(IDS).flatten(0, 1), IDS.flatten())
        loss.backward()
        return loss.item(), tp.gather_grads(m, pg), tp.TPGroup.from_process_group(backend).size

    def once():
        store = dist.HashStore()  # a new group each time
        return run_workers(lambda k: rank(k, store), 2, 30.0)

    for loss, grads, size in gloo_once_more(once, "a torch process group"):
        assert loss == pytest.approx(want_loss, rel=1e-5) and size == 2
        for n in want:
            _close(grads[n], want[n], n)


@pytest.mark.parametrize("bad", [2, "tp", object()])
def test_anything_else_as_a_group_is_a_type_error_naming_it(bad):
    with pytest.raises(TypeError, match=rf"tp.split: group: expected a shardps.tp.TPGroup, a torch.distributed "
                                        rf"ProcessGroup or None, got {type(bad).__name__}"):
        tp.split(TiedLM(), PLAN, bad)
    with pytest.raises(TypeError, match="TPGroup, a torch.distributed ProcessGroup or None"):
        tp.ColumnParallelLinear(4, 4, group=bad)


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class NamedLinear(nn.Linear):
    """A subclass that adds no work: split as nn.Linear."""


def test_a_subclass_with_its_own_forward_is_refused_by_name():
    model = nn.Sequential(ScaledLinear(4, 6), nn.ReLU(), NamedLinear(6, 4))
    with pytest.raises(ValueError, match=r"tp.split: 0 \(ScaledLinear\) subclasses nn.Linear with a forward of its "
                                         r"own; 'column' would replace it"):
        tp.split(model, {"0": "column", "2": "row"})
    assert type(model[0]) is ScaledLinear and type(model[2]) is NamedLinear  # nothing changed
    tp.split(model, {"2": "row"})
    assert isinstance(model[2], tp.RowParallelLinear)


def test_a_module_with_hooks_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    model[0].register_forward_hook(lambda m, i, o: o * 3)
    with pytest.raises(ValueError, match=r"tp.split: 0 \(Linear\) has _forward_hooks; 'column' would replace"):
        tp.split(model, {"0": "column", "2": "row"})
    assert type(model[0]) is nn.Linear
    other = nn.Linear(4, 4)
    other.forward = lambda x: nn.Linear.forward(other, x) * 2  # an instance's own forward (accelerate's way)
    with pytest.raises(ValueError, match=r"has a forward set on the module itself"):
        tp.split(nn.ModuleDict({"l": other}), {"l": "column"})


def test_an_embedding_keeps_padding_idx_and_refuses_options_it_would_drop():
    model = TiedLM(padding_idx=0)  # IDS holds 0: its row must get no gradient from the embedding
    _, want = _dense(model)

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), {"embed": "vocab", "head": "column"}, group)
        logits = m(IDS)  # the head's output split: the parallel loss
        loss = tp.vocab_parallel_cross_entropy(logits.flatten(0, 1), IDS.flatten(), group, vocab=VOCAB)
        loss.backward()
        return tp.gather_grads(m, group)

    for grads in run_tp(2, rank):
        _close(grads["embed.weight"], want["embed.weight"], "embed.weight")
    emb = nn.Embedding(VOCAB, DIM, max_norm=1.0)
    with pytest.raises(ValueError, match=r"tp.split: e: an nn.Embedding with max_norm=1.0 is not split"):
        tp.split(nn.ModuleDict({"e": emb}), {"e": "vocab"})


class HeadNormAttention(nn.Module):
    """q projected, normalised per head (a norm whose weight is per head_dim, replicated), projected back:
    with q split by columns, each rank's norm gradient covers its own heads only (Qwen3's q_norm)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.head_dim = 4
        self.q = nn.Linear(DIM, 4 * self.head_dim)
        self.norm = nn.LayerNorm(self.head_dim)
        self.o = nn.Linear(4 * self.head_dim, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.norm(self.q(x).view(*x.shape[:-1], -1, self.head_dim))
        return self.o(q.flatten(-2))


@pytest.mark.parametrize("kind", ["partial_grad", None])
def test_a_partial_gradient_of_a_replicated_parameter_is_summed_over_the_group(kind):
    model = HeadNormAttention()
    x = torch.randn(3, 5, DIM, generator=torch.Generator().manual_seed(2))
    dense = copy.deepcopy(model)
    dense(x).square().mean().backward()
    plan = {"q": "column", "o": "row", **({"norm": kind} if kind else {})}

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), plan, group)
        for _ in range(2):  # two backwards accumulate: each one's share summed once
            m(x).square().mean().backward()
        return tp.gather_grads(m, group)

    for grads in run_tp(2, rank):
        got, want = grads["norm.weight"], 2 * dense.norm.weight.grad
        if kind:
            _close(got, want, "norm.weight")
            _close(grads["q.weight"], 2 * dense.q.weight.grad, "q.weight")
        else:  # without the kind each rank holds only its heads' share: what the kind exists for
            assert not torch.allclose(got, want, rtol=1e-3, atol=1e-5)


def test_heads_that_do_not_divide_by_the_tp_size_are_refused():
    model = HeadNormAttention()  # 4 heads of 4
    with pytest.raises(ValueError, match=r"tp.split: q \(4 heads of 4\): 4 attention heads do not split over a "
                                         r"TP group of 3"):
        tp.split(model, {"q": "column", "o": "row"}, tp.TPGroup(None, 0, 3))
    assert type(model.q) is nn.Linear


# -- found in review: each pins a case that changed the model, or trained it wrong, without a word ----------


def test_partial_grad_twice_or_shared_sums_each_gradient_once():
    model = HeadNormAttention()
    x = torch.randn(3, 5, DIM, generator=torch.Generator().manual_seed(2))
    dense = copy.deepcopy(model)
    dense(x).square().mean().backward()

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), {"q": "column", "o": "row", "norm": "partial_grad"}, group)
        with pytest.raises(ValueError, match=r"tp.split: norm is 'partial_grad' already \(split twice\?\)"):
            tp.split(m, {"norm": "partial_grad"}, group)
        for _ in range(3):  # one hook however many forwards: each backward's share summed once
            m.zero_grad()
            m(x).square().mean().backward()
        return tp.gather_grads(m, group)

    for grads in run_tp(2, rank):
        _close(grads["norm.weight"], dense.norm.weight.grad, "norm.weight")


def test_a_partial_grad_weight_tied_to_a_plain_use_is_refused():
    model = HeadNormAttention()
    model.extra = nn.LayerNorm(4)
    model.extra.weight = model.norm.weight
    with pytest.raises(ValueError, match=r"norm.weight and extra.weight are one tensor \(tied weights\); "
                                         r"'partial_grad' on norm cuts it not at all, its gradient summed"):
        tp.split(model, {"q": "column", "o": "row", "norm": "partial_grad"}, tp.TPGroup(None, 0, 2))
    assert type(model.q) is nn.Linear and not model.norm._forward_pre_hooks


class Attn(nn.Module):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = 2, nn.Linear(4, width), nn.Linear(4, 4)


def test_a_target_inside_another_or_a_fused_qkv_that_is_not_three_parts_changes_nothing():
    model = nn.ModuleDict({"fc": nn.Linear(4, 4), "attn": Attn(width=10)})
    with pytest.raises(ValueError, match=r"attn.qkv: 10 output features are not a fused query, key and value"):
        tp.split(model, {"fc": "column", "attn": "heads"}, tp.TPGroup(None, 0, 2))
    assert type(model["fc"]) is nn.Linear  # checked before anything changed
    model = nn.ModuleDict({"attn": Attn()})
    for plan in ({"attn": "heads", "attn.proj": "row"}, {"attn.proj": "row", "attn": "heads"}):
        with pytest.raises(ValueError, match=r"tp.split: attn.proj \('row'\) is inside attn \('heads'\), which "
                                             r"splits it already"):
            tp.split(model, plan, tp.TPGroup(None, 0, 2))
        assert type(model["attn"].proj) is nn.Linear


def test_one_module_under_two_names_is_split_under_both():
    layer = nn.Linear(DIM, DIM)
    model = nn.Sequential(nn.Linear(DIM, DIM), layer, nn.Tanh(), layer)  # shared across depth (ALBERT-style)
    x = torch.randn(2, DIM)
    dense = copy.deepcopy(model)
    dense(x).square().sum().backward()

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), {"1": "column_gather"}, group)  # whole in, whole out: usable twice
        assert m[1] is m[3] and isinstance(m[3], tp.ColumnParallelLinear)
        m(x).square().sum().backward()
        return tp.gather_grads(m, group)

    for grads in run_tp(2, rank):
        for n, p in dense.named_parameters():
            _close(grads[n], p.grad, n)


def test_a_pipelines_tp_plan_must_be_a_mapping():
    from shardps.worker.tp.split import check_tp

    with pytest.raises(TypeError, match=r"tp_plan: expected a mapping .* 'auto' cannot read its plan"):
        check_tp(2, "auto", [nn.Sequential(nn.Linear(2, 2))], None, "bsp")  # type: ignore[arg-type]
