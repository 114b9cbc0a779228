"""Tensor parallelism (shardps.tp): split models equal the unsplit one, in forward, loss and every gradient.

The TP ranks are threads of this process, each with its own gloo group on one shared ``HashStore`` (no
process per rank: the suite's CPU budget), exactly as ranks in processes would be (the groups are the
same objects ``worker/groups.py`` builds for a pipeline's stages).
"""

from __future__ import annotations

import copy
import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardps.tp as tp
from shardps.examples import shakespeare as gpt
from tests.helpers import run_workers

_names = itertools.count()
_RNG = threading.Lock()
RTOL, ATOL = 1e-5, 1e-6


def run_tp(p: int, fn: Callable[[int, tp.TPGroup], Any], timeout: float = 30.0) -> list[Any]:
    """``fn(rank, group)`` on ``p`` threads, each a rank of one new gloo TP group.

    Gloo's ranks connect to each other's listening sockets on ephemeral loopback ports; a process of another test
    beside this one (the suite runs in several) that connects to a port it believes free can land on one, and
    gloo's handshake then fails ("connectFullMesh failed ... Connection closed by peer": seen once in a
    fresh-clone run). That is the rendezvous, not the code under test: it is tried once more with a new group,
    and a second failure is raised."""
    def once() -> list[Any]:
        store = torch.distributed.HashStore()
        name = f"tp/test{next(_names)}"
        return run_workers(lambda k: fn(k, tp.open_tp_group(store, name, k, p, timeout=timeout)), p, timeout)

    return gloo_once_more(once, "run_tp")


T = TypeVar("T")


def gloo_once_more(once: Callable[[], T], what: str) -> T:
    """``once()`` (which opens gloo groups afresh each call), made a second time when gloo's rendezvous failed
    to connect (run_tp says why); any other failure, or a second one, is raised."""
    try:
        return once()
    except RuntimeError as e:
        if "connectFullMesh failed" not in str(e):
            raise
        print(f"{what}: gloo's rendezvous failed ({str(e)[:200]}): once more", file=sys.stderr)
    return once()


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _dense_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, dict]:
    out = model(x)
    loss = gpt.CharLoss()(out, y)
    loss.backward()
    return out.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("p", [2, 4])
def test_char_gpt_split_equals_the_unsplit_model(p):
    vocab, layers = 65, 2  # 65 divides by neither 2 nor 4: the last rank's vocabulary slice is shorter
    model = gpt.make_model(vocab, dim=32, heads=4, layers=layers, context=16, seed=3)
    x = torch.randint(vocab, (3, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(vocab, (3, 16), generator=torch.Generator().manual_seed(2))
    want_out, want_loss, want_grads = _dense_step(copy.deepcopy(model), x, y)

    def rank(k: int, group: tp.TPGroup) -> tuple[torch.Tensor, float, dict, dict, dict]:
        m = tp.split(copy.deepcopy(model), gpt.tp_plan(layers), group)
        logits = m(x)
        loss = gpt.TPCharLoss(vocab, group)(logits, y)
        loss.backward()
        whole = torch.cat(group.all_gather_padded(logits.detach(), 2, [b - a for a, b in (
            tp.chunk_range(vocab, p, r) for r in range(p))]), 2)
        return whole, loss.item(), tp.gather_grads(m, group), tp.gather(m, group), dict(m.named_parameters())

    results = run_tp(p, rank)
    for k, (out, loss, grads, state, _) in enumerate(results):
        _close(out, want_out, f"rank {k} logits")
        assert loss == pytest.approx(want_loss, rel=RTOL)
        assert grads.keys() == want_grads.keys()  # the names do not change when a model is split
        for n in want_grads:
            _close(grads[n], want_grads[n], f"rank {k} grad {n}")
            assert torch.equal(state[n], model.state_dict()[n]), n  # gather gives the dense weights back
    # each rank holds torch.chunk's slice: vocabulary rows, q/k/v columns per part, fc2's input columns
    _, _, _, _, local = results[-1]
    last = torch.chunk(model[0].tok.weight, p, 0)[-1]
    assert torch.equal(local["0.tok.weight"], last)
    assert torch.equal(local["1.mlp.2.weight"], torch.chunk(model[1].mlp[2].weight, p, 1)[-1])
    assert torch.equal(local["1.qkv.weight"], torch.cat([torch.chunk(w, p, 0)[-1]
                                                         for w in model[1].qkv.weight.chunk(3, 0)]))


def test_block_of_the_parallel_modules_equals_dense_and_counts_its_collectives():
    torch.manual_seed(0)
    dim, heads = 16, 4
    attn_qkv, attn_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
    x = torch.randn(2, 5, dim, requires_grad=True)

    def dense(z: torch.Tensor) -> torch.Tensor:
        b, t, d = z.shape
        q, k, v = (u.view(b, t, heads, d // heads).transpose(1, 2) for u in attn_qkv(z).chunk(3, -1))
        return attn_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))

    want = dense(x)
    want.sum().backward()
    want_gx = x.grad.clone()

    def rank(k: int, group: tp.TPGroup) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
        attn = tp.ParallelSelfAttention(dim, heads, group=group, dense=(attn_qkv, attn_proj))
        xk = x.detach().clone().requires_grad_()
        out = attn(xk)
        out.sum().backward()
        return out.detach(), xk.grad, tp.gather_grads(attn, group), dict(group.collectives)

    for out, gx, grads, counts in run_tp(2, rank):
        _close(out, want.detach(), "attention output")
        _close(gx, want_gx, "input gradient")
        _close(grads["qkv.weight"], attn_qkv.weight.grad, "qkv.weight grad")
        _close(grads["proj.weight"], attn_proj.weight.grad, "proj.weight grad")
        # one all-reduce forward (g after proj), one backward (f before qkv); the gathers are the test's
        assert counts["all_reduce_sum"] == 2


def test_mlp_direct_construction_is_the_same_model_at_every_tp_size():
    def build(k: int, group: tp.TPGroup) -> dict:
        with _RNG:  # the ranks are threads sharing the default stream; ranks in processes have their own
            torch.manual_seed(7)
            mlp = tp.ParallelMLP(8, 20, group=group)
        return tp.gather(mlp, group)

    one = build(0, tp.TPGroup.single())
    for state in run_tp(4, build):  # 20 hidden over 4 ranks: 5 each
        assert state.keys() == one.keys()
        for n in one:
            assert torch.equal(state[n], one[n]), n


def test_vocabulary_smaller_than_the_tp_size_leaves_a_rank_empty_and_stays_exact():
    vocab = 5  # torch.chunk(5 rows, 4) gives 3 chunks: rank 3 holds no row
    emb, head = nn.Embedding(vocab, 6), nn.Linear(6, vocab)
    ids = torch.tensor([[0, 4, 2, 3]])
    target = torch.tensor([[4, 0, 1, 2]])
    loss = F.cross_entropy(head(emb(ids)).reshape(-1, vocab), target.reshape(-1))
    loss.backward()

    def rank(k: int, group: tp.TPGroup) -> tuple[float, dict, int]:
        m = nn.Sequential(copy.deepcopy(emb), copy.deepcopy(head))
        tp.split(m, {"0": "vocab", "1": "column"}, group)
        lk = tp.vocab_parallel_cross_entropy(m(ids).flatten(0, 1), target.flatten(), group)
        lk.backward()
        return lk.item(), tp.gather_grads(m, group), m[0].weight.shape[0]

    results = run_tp(4, rank)
    assert [rows for _, _, rows in results] == [2, 2, 1, 0]
    for lk, grads, _ in results:
        assert lk == pytest.approx(loss.item(), rel=RTOL)
        _close(grads["0.weight"], emb.weight.grad, "embedding grad")
        _close(grads["1.weight"], head.weight.grad, "head grad")
        _close(grads["1.bias"], head.bias.grad, "head bias grad")


def test_bad_plans_are_refused_naming_what_and_change_nothing():
    model = gpt.make_model(11, dim=12, heads=3, layers=1, context=4)
    before = copy.deepcopy(model.state_dict())
    group = _FakeGroup(2)
    with pytest.raises(ValueError, match=r"1: 3 attention heads do not split over a TP group of 2"):
        tp.split(model, gpt.tp_plan(1), group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pattern '\*\.fc9' matches no module"):
        tp.split(model, {"0.tok": "vocab", "*.fc9": "row"}, group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0.tok is a Embedding; 'row' splits nn.Linear modules"):
        tp.split(model, {"0.tok": "row"}, group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind must be one of column, column_gather, row, vocab, heads, "
                                         "partial_grad, got 'diagonal'"):
        tp.split(model, {"0.tok": "diagonal"}, group)  # type: ignore[arg-type]
    assert isinstance(model[0].tok, nn.Embedding) and isinstance(model[1].qkv, nn.Linear)
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    with pytest.raises(ValueError, match="expected 6 logits, got 5"):
        tp.vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), vocab=6)


class _FakeGroup(tp.TPGroup):
    """A group of ``size`` ranks for checks that run before any collective."""

    def __init__(self, size: int) -> None:
        super().__init__(object(), 0, size)


def test_dropout_masks_match_where_replicated_and_differ_where_split():
    def rank(k: int, group: tp.TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
        with _RNG:  # threads share the default stream: one rank at a time
            return draw(group)

    def draw(group: tp.TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(11)  # every rank seeds the default stream the same
        tracker = tp.RNGTracker(seed=11, rank=group.rank)
        ones = torch.ones(64)
        replicated = F.dropout(ones, 0.5)
        with tracker.fork():
            split = F.dropout(ones, 0.5)
        after = F.dropout(ones, 0.5)  # the default stream went on as if the fork had not been there
        torch.manual_seed(11)
        F.dropout(ones, 0.5)
        assert torch.equal(after, F.dropout(ones, 0.5))
        return replicated, split

    (rep0, split0), (rep1, split1) = run_tp(2, rank)
    assert torch.equal(rep0, rep1)
    assert not torch.equal(split0, split1)


def test_clip_grad_norm_counts_every_slice_and_replicated_parameters_once():
    model = gpt.make_model(13, dim=16, heads=2, layers=1, context=8, seed=5)
    x = torch.randint(13, (2, 8), generator=torch.Generator().manual_seed(0))
    dense = copy.deepcopy(model)
    gpt.CharLoss()(dense(x), x).backward()
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1)
    want_grads = {n: p.grad for n, p in dense.named_parameters()}

    def rank(k: int, group: tp.TPGroup) -> tuple[torch.Tensor, dict]:
        m = tp.split(copy.deepcopy(model), gpt.tp_plan(1), group)
        gpt.TPCharLoss(13, group)(m(x), x).backward()
        norm = tp.clip_grad_norm_(m, 0.1, group)
        return norm, tp.gather_grads(m, group)

    for norm, grads in run_tp(2, rank):
        _close(norm, want, "norm")
        for n, g in want_grads.items():
            _close(grads[n], g, f"clipped grad {n}")
