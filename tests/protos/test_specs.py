import pytest

from shardps import optim
from shardps.protos.optim import spec_from_proto
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.syncspec import SyncSpec


def test_torch_defaults():
    assert optim.Adam() == optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False)
    assert optim.AdamW().weight_decay == 1e-2
    assert optim.SGD().lr == 1e-3 and optim.SGD().momentum == 0.0


@pytest.mark.parametrize("spec", [optim.Adam(lr=3e-4, amsgrad=True), optim.AdamW(betas=(0.8, 0.99)),
                                  optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)])
def test_wire_round_trip(spec):
    assert spec_from_proto(spec.to_proto()) == spec


@pytest.mark.parametrize("make, match", [
    (lambda: optim.Adam(lr=-1), "lr must be >= 0, got -1"),
    (lambda: optim.Adam(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
    (lambda: optim.Adam(eps=float("nan")), "eps must be a finite number"),
    (lambda: optim.SGD(nesterov=True), "nesterov needs momentum > 0"),
])
def test_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_wire_errors():
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        spec_from_proto(ps_pb2.OptimizerSpec(name="lamb"))
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['momentum'\]"):
        spec_from_proto(ps_pb2.OptimizerSpec(name="adam", params_json='{"momentum": 0.9}'))
    with pytest.raises(ValueError, match="not valid JSON"):
        spec_from_proto(ps_pb2.OptimizerSpec(name="adam", params_json="{"))


@pytest.mark.parametrize("text, kind, every",
                         [("bsp", "bsp", 1), ("ASP", "asp", 1), ("every:4", "every", 4), ("ssp:2", "ssp", 1)])
def test_sync_parse(text, kind, every):
    s = SyncSpec.parse(text)
    assert (s.kind, s.every) == (kind, every)
    assert SyncSpec.parse(str(s)) == s


@pytest.mark.parametrize("text", ["every:0", "every:x", "sometimes", "", "ssp:-1", "ssp:x"])
def test_sync_parse_errors(text):
    with pytest.raises(ValueError):
        SyncSpec.parse(text)
