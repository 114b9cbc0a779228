"""A stage's parameter-server side (``StageWeights``) alone: a fake stepper stands in for the servers."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from shardps.protos.syncspec import SyncSpec
from shardps.worker.pipeline.stage import StageRuntime
from shardps.worker.pipeline.weights import StageWeights

LR = 0.1


class FakeStepper:
    """SGD on the masters in place, as a pull of the servers' new weights would leave them. ``gate``: the
    push and pull block until it is set (to hold a background sync in flight); ``fail``: they raise."""

    def __init__(self, masters: list[tuple[str, torch.Tensor]], fail: bool = False,
                 gate: threading.Event | None = None) -> None:
        self.masters, self.fail, self.gate, self.steps = dict(masters), fail, gate, 0

    def step(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("push refused")
        with torch.no_grad():
            for t in self.masters.values():
                if t.grad is not None:
                    t.sub_(LR * t.grad)
        self.steps += 1

    def zero_grad(self) -> None:
        for t in self.masters.values():
            t.grad = None


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def stage(sync: str, weight_delay: int = 1, timeout: float = 600.0, overlap: bool = True,
          **fake: object) -> tuple[StageRuntime, StageWeights, list[FakeStepper]]:
    rt = StageRuntime(linear(), 0, 1, checkpoint="never", loss_fn=nn.MSELoss(reduction="sum"))
    made: list[FakeStepper] = []

    def make(masters: list[tuple[str, torch.Tensor]]) -> FakeStepper:
        made.append(FakeStepper(masters, **fake))  # type: ignore[arg-type]
        return made[-1]

    return rt, StageWeights(rt, SyncSpec.parse(sync), weight_delay, make, timeout=timeout, overlap=overlap), made


X, T = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.randn(3, 2)


def forwards(rt: StageRuntime, w: StageWeights, step: int, chunks: int, after: int = -1,
             then: threading.Event | None = None) -> None:
    rt.begin_step(step, chunks)
    w.begin_step()
    for mb in range(chunks):
        w.before_forward(mb)
        rt.forward(mb, X[mb:mb + 1])
        if mb == after and then is not None:
            then.set()


def backwards(rt: StageRuntime, chunks: int) -> None:
    for mb in reversed(range(chunks)):
        rt.backward(mb, target=T[mb:mb + 1])


@pytest.mark.parametrize("sync, stash, delay", [("bsp", False, 0), ("every:2", False, 0), ("asp", True, 2),
                                                ("ssp:1", True, 2)])
def test_stashing_follows_the_sync_modes_spec(sync, stash, delay):
    _, w, _ = stage(sync, weight_delay=2)
    assert (w.stash, w.weight_delay) == (stash, delay)


@pytest.mark.parametrize("sync, overlap", [("bsp", True), ("asp", False), ("ssp:1", False)])
def test_bsp_or_asp_without_overlap_runs_on_the_masters_and_equals_sgd_in_one_process(sync, overlap):
    # asp/ssp with overlap=False (a stage with row modules): the push and pull in sync(), as under bsp
    rt, w, (fake,) = stage(sync, overlap=overlap)
    assert (w.stash, w.weight_delay) == (False, 0)
    ref = linear()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(3):
        forwards(rt, w, step, 3)
        backwards(rt, 3)
        assert w.sync() == step + 2  # installed at once: version 1 at the start, one more per pull
        opt.zero_grad()
        nn.MSELoss(reduction="sum")(ref(X), T).backward()
        opt.step()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(rt.params[n].detach(), p.detach(), msg=n)
    assert fake.steps == 3 and all(rt.params[n].data_ptr() == w.masters[n].data_ptr() for n in w.masters)


def test_a_failed_bsp_sync_is_raised_not_lost():
    """Review finding: the sync's error was kept for a background pull that bsp never starts."""
    rt, w, _ = stage("bsp", fail=True)
    forwards(rt, w, 0, 1)
    backwards(rt, 1)
    with pytest.raises(RuntimeError, match="push refused"):
        w.sync()


def test_new_weights_are_installed_even_when_the_delay_covers_every_micro_batch():
    """Review finding: with weight_delay >= chunks (chunks=1 and the default delay of 1), no forward waited
    for the pull under asp, and the stage trained on its first weights for ever."""
    rt, w, (fake,) = stage("asp", weight_delay=1)
    for step in range(3):
        forwards(rt, w, step, 1)
        backwards(rt, 1)
        w.sync()
    assert w.wait() == 4 and fake.steps == 3  # three pulls, three versions installed after the first


def test_under_asp_the_pull_overlaps_the_next_step_and_each_backward_runs_on_its_forwards_weights():
    gate = threading.Event()
    rt, w, (fake,) = stage("asp", weight_delay=1, gate=gate)
    w0 = {n: t.detach().clone() for n, t in w.masters.items()}
    forwards(rt, w, 0, 3)
    backwards(rt, 3)
    g0 = rt.gradients()
    assert w.sync() == 1  # the push and pull are held at the gate: forwards still run on version 1
    forwards(rt, w, 1, 3, after=0, then=gate)  # micro-batch 0 on the old weights; 1 waits for the pull
    backwards(rt, 3)
    assert [v for v in rt.versions if v[0] == 1] == [(1, 2, 2, 2), (1, 1, 2, 2), (1, 0, 1, 1)]
    w1 = {n: w0[n] - LR * g0[n] for n in w0}
    expected = {n: torch.zeros_like(t) for n, t in w0.items()}
    for mb, weights in ((0, w0), (1, w1), (2, w1)):
        m = copy.deepcopy(linear())
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(weights[n])
        nn.MSELoss(reduction="sum")(m(X[mb:mb + 1]), T[mb:mb + 1]).backward()
        for n, p in m.named_parameters():
            expected[n] += p.grad
    got = rt.gradients()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], msg=n)
    assert fake.steps == 1 and len(w.intervals) == 1


def test_a_failed_background_sync_is_raised_by_the_forward_that_waits_for_it():
    rt, w, _ = stage("ssp:1", weight_delay=1, fail=True)
    forwards(rt, w, 0, 2)
    backwards(rt, 2)
    w.sync()
    rt.begin_step(1, 2)
    w.before_forward(0)  # within the delay: does not wait
    with pytest.raises(RuntimeError, match="push refused"):
        w.before_forward(1)


def test_a_background_sync_that_does_not_land_is_a_timeout_naming_the_stage_not_a_hang():
    gate = threading.Event()
    rt, w, [fake] = stage("asp", weight_delay=1, timeout=0.2, gate=gate)
    forwards(rt, w, 0, 2)
    backwards(rt, 2)
    w.sync()  # the push and pull wait at the gate, in the background
    rt.begin_step(1, 2)
    try:
        with pytest.raises(TimeoutError, match=r"stage 0: the background push and pull did not land within "
                                               r"0.2 s \(forwards run on version 1\)"):
            w.before_forward(1)
    finally:
        gate.set()
    assert w.wait() == 2 and fake.steps == 1  # landed once the gate opened: its weights installed
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        StageWeights(rt, SyncSpec.parse("bsp"), 1, timeout=0)


def test_without_servers_it_only_reports_the_version():
    rt = StageRuntime(linear(), 0, 1, checkpoint="never", loss_fn=nn.MSELoss())
    w = StageWeights(rt, SyncSpec.parse("asp"), 1)
    rt.begin_step(0, 2)
    w.before_forward(1)
    assert (w.sync(), w.wait(), w.masters) == (0, 0, {})
    with pytest.raises(ValueError, match="weight_delay must be >= 0, got -1"):
        StageWeights(rt, SyncSpec.parse("bsp"), -1)
