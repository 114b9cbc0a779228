"""Staleness remedies: lr scaled by 1/(s+1), and DC-ASGD delay compensation. Off by default."""

import pytest
import torch

import shardps
from shardps import optim
from shardps.protos import codec
from shardps.server.errors import FailedPrecondition, InvalidArgument
from shardps.server.remedies import Remedy
from shardps.server.store import ShardStore, TensorSpec

W0 = torch.tensor([1.0, 2.0, -1.0, 0.5])


def _store(remedy: str, spec=None) -> ShardStore:
    st = ShardStore(0, 1)
    st.path.configure(2, "asp", remedy=remedy)
    st.path.register_tensors([TensorSpec("w", (4,), codec.to_wire_dtype(torch.float32), spec or optim.SGD(lr=0.5),
                                    ((0, 4),))], {("w", 0): W0.clone()})
    st.leases.register(0)
    st.leases.register(1)
    return st


def _push(st, worker, step, base, g):
    return st.path.submit(worker, step, base, {("w", 0): g.clone()})


def test_parse():
    assert Remedy.parse(None) == Remedy() and str(Remedy.parse("lr-scale")) == "lr-scale"
    assert Remedy.parse("dc-asgd:0.5") == Remedy("dc-asgd", 0.5) and Remedy.parse("dc-asgd").dc_lambda == 0.04
    for bad in ("sometimes", "dc-asgd:-1", "dc-asgd:x"):
        with pytest.raises(ValueError):
            Remedy.parse(bad)


@pytest.mark.parametrize("remedy", ["none", "lr-scale"])
def test_lr_scale_divides_the_step_by_staleness_plus_one(remedy):
    st = _store(remedy)
    g0, g1 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([2.0, -2.0, 4.0, 0.0])
    _push(st, 0, 0, 0, g0)  # staleness 0
    _push(st, 1, 0, 0, g1)  # computed from version 0, applied at version 1: staleness 1
    factor = 0.5 if remedy == "lr-scale" else 1.0
    assert torch.equal(st.reader.weights("w")[0], W0 - 0.5 * g0 - 0.5 * factor * g1)
    assert st.applier.staleness_counts == {0: 1, 1: 1}


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_dc_asgd_compensates_with_the_weights_the_worker_pulled(lam):
    st = _store(f"dc-asgd:{lam}")
    st.reader.read(["w"], None, worker_id=1)  # worker 1 computes its gradient from W0
    g0, g1 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([2.0, -2.0, 4.0, 0.5])
    _push(st, 0, 0, 0, g0)
    w1 = W0 - 0.5 * g0
    _push(st, 1, 0, 0, g1)
    compensated = g1 + lam * g1 * g1 * (w1 - W0)
    assert torch.equal(st.reader.weights("w")[0], w1 - 0.5 * compensated)


def test_remedies_are_job_settings_checked_like_the_rest():
    st = _store("lr-scale")
    with pytest.raises(FailedPrecondition, match="runs staleness remedy lr-scale; a worker asked for none"):
        st.path.configure(2, "asp")
    with pytest.raises(InvalidArgument, match="unknown staleness remedy"):
        ShardStore(0, 1).path.configure(2, "asp", remedy="magic")
    st2 = ShardStore(0, 1)
    st2.path.configure(1, "asp", remedy="lr-scale")
    with pytest.raises(FailedPrecondition, match="lr-scale needs an optimizer with a fixed lr"):
        st2.path.register_tensors([TensorSpec("a", (4, 4), 1, optim.Adafactor(), ((0, 16),))], {("a",
                                                                                                 0): torch.ones(16)})


def test_remedy_through_grpc(cluster2):
    with shardps.connect(cluster2.addresses, worker_id=0, num_workers=1) as client:
        client.register({"w": W0.clone()}, optim.SGD(lr=0.5), sync="asp", staleness_remedy="dc-asgd:0.1")
        assert [s.applier.remedy for s in cluster2.stores if s.names()] == [Remedy("dc-asgd", 0.1)]
