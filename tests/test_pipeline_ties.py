"""A weight tied between a module of the first stage and one of the last (an embedding and the output head) is
one tensor across a pipeline: one name in every stage that uses it, its gradient the sum of the stages' parts.

Regression pinned: each stage named the tied weight as its own module did (``0.weight`` in the first stage,
``3.weight`` in the last), so a pipeline's gradients held two tensors where the model has one, and on the
servers each stage trained its own copy. The servers' side is in tests/test_pipeline_ray.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.worker.pipeline.local import LocalPipeline
from shardps.worker.pipeline.partition import split_model, stage_ties

VOCAB, DIM = 11, 6


def tied_lm() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB, bias=False))
    model[3].weight = model[0].weight
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (6, 5), generator=g), torch.randint(VOCAB, (6, 5), generator=g)


def test_stage_ties_name_a_weight_shared_by_two_stages_once():
    ties = stage_ties(split_model(tied_lm(), [2, 2]))
    assert ties.aliases == ({}, {"3.weight": "0.weight"}) and ties.shared == {"0.weight": 2}
    untied = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
    assert stage_ties(split_model(untied, [1, 1])).shared == {}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_tied_weight_across_stages_gets_the_unsplit_models_gradient(schedule):
    model, (x, y) = tied_lm(), batch()
    ref = copy.deepcopy(model)
    want_loss = lm_loss(ref(x), y)
    want_loss.backward()
    pipe = LocalPipeline(model, balance=[2, 2], chunks=3, schedule=schedule)
    loss = pipe.train_step(x, y, lm_loss)
    assert loss == pytest.approx(want_loss.item(), rel=1e-5)
    got = pipe.gradients()
    assert got.keys() == {n for n, _ in ref.named_parameters()}  # "0.weight" once, no "3.weight"
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert pipe.state_dict().keys() == model.state_dict().keys()  # the tied weight under both names


def test_a_list_of_stages_sharing_a_weight_keeps_it_shared_and_the_state_has_every_name():
    """Found in review: LocalPipeline copied each stage of a list alone (the tie became two tensors), and a
    pipeline's state_dict gave a tied weight under its first name only (load_state_dict refused it)."""
    model, (x, y) = tied_lm(), batch()
    ref = copy.deepcopy(model)
    lm_loss(ref(x), y).backward()
    pipe = LocalPipeline([model[:2], model[2:]], balance=None, chunks=2)
    pipe.train_step(x, y, lm_loss)
    got = pipe.gradients()
    assert set(got) == {"0.0.weight", "0.1.weight", "0.1.bias"}  # the head's weight is the embedding's
    torch.testing.assert_close(got["0.0.weight"], ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    whole = LocalPipeline(model, balance=[2, 2], chunks=2).state_dict()
    assert whole.keys() == model.state_dict().keys()
    copy.deepcopy(model).load_state_dict(whole)  # strict: every name, the tied one under both
