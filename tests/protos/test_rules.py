import pytest
import torch

from shardps import optim
from shardps.protos.rules import Rules, max_rank, min_rank


def test_first_matching_rule_wins_then_default():
    rules = Rules([("*norm*", optim.Adam(lr=1e-3)), ("*.bias", optim.SGD(lr=0.1)), (min_rank(2), optim.AdamW())],
                  default=optim.Adam(lr=5e-4))
    named = [("ln.norm.weight", torch.zeros(8)), ("fc.bias", torch.zeros(8)), ("fc.weight", torch.zeros(8, 4)),
             ("scale", torch.zeros(3)), ("norm.w2", torch.zeros(2, 2))]
    assert rules.describe(named) == {"ln.norm.weight": "adam", "fc.bias": "sgd", "fc.weight": "adamw",
                                     "scale": "adam", "norm.w2": "adam"}
    assert rules("scale", torch.zeros(3)).lr == 5e-4
    assert Rules([(max_rank(1), optim.SGD())], default=optim.Adam())("b", torch.zeros(3)).name == "sgd"


def test_rules_are_checked():
    with pytest.raises(TypeError, match="rule 0: match must be a glob string or a callable"):
        Rules([(3, optim.Adam())], default=optim.Adam())
    with pytest.raises(TypeError, match="rule 0: expected an optimizer spec"):
        Rules([("*", "adam")], default=optim.Adam())
