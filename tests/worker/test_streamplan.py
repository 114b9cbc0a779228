"""The pure parts of a streamed model's plan (worker/streaming/plan.py), as tables."""

from __future__ import annotations

import pytest
from torch import nn

from shardps.worker.streaming.plan import ahead, fits, schedule, units


def test_schedule_is_forward_then_backward_in_reverse():
    assert schedule(3) == [("f", 0), ("f", 1), ("f", 2), ("b", 2), ("b", 1), ("b", 0)]
    assert schedule(0) == []


@pytest.mark.parametrize("at, prefetch, expected", [
    (("f", 0), 1, [("f", 1)]),
    (("f", 1), 2, [("f", 2), ("b", 2)]),  # the last forward's weights are kept for its backward
    (("b", 1), 3, [("b", 0)]),  # the end of the step
    (("b", 0), 1, []),
    (("f", 0), 0, []),
    (("f", 7), 1, []),  # not in the plan (a forward that went another way)
])
def test_ahead(at, prefetch, expected):
    assert ahead(schedule(3), at, prefetch) == expected


@pytest.mark.parametrize("live, more, budget, ok", [(0, 10, 10, True), (5, 6, 10, False), (0, 0, 0, True)])
def test_fits(live, more, budget, ok):
    assert fits(live, more, budget) is ok


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_default_units_are_modules_with_parameters_of_their_own():
    net = Net()
    params = dict(net.named_parameters())
    got = [(u.names, u.nbytes) for u in units(net, params, None)]
    assert got == [
        (("emb.weight",), 128),
        (("blocks.0.a.weight", "blocks.0.a.bias"), 80),
        (("blocks.0.b.weight",), 64),
        (("blocks.1.a.weight", "blocks.1.a.bias"), 80),
        (("blocks.1.b.weight",), 64),
        (("emb.weight",), 128),  # the tied head: the same tensor, in both units
    ]


def test_named_modules_take_their_children_and_the_rest_stay_units():
    net = Net()
    params = dict(net.named_parameters())
    got = [u.names for u in units(net, params, list(net.blocks))]
    assert got == [("emb.weight",), ("blocks.0.a.weight", "blocks.0.a.bias", "blocks.0.b.weight"),
                   ("blocks.1.a.weight", "blocks.1.a.bias", "blocks.1.b.weight"), ("emb.weight",)]


def test_bad_module_lists_are_named():
    net = Net()
    params = dict(net.named_parameters())
    with pytest.raises(ValueError, match="Linear is not a module of the model"):
        units(net, params, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="a ModuleList has no forward to hook"):
        units(net, params, [net.blocks])
    with pytest.raises(ValueError, match="Linear is inside Block, also named"):
        units(net, params, [net.blocks[0], net.blocks[0].a])
