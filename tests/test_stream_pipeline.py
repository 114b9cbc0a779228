"""A pipeline stage's weights streamed from the servers (``StreamWeights``, ``StageStreamer``) change where
bytes are, never the arithmetic.

Each stage runs as the Ray stage actor runs it (``StageRuntime`` and its weights side, walking its own order
of the plan, the stages handing values over a ``Mailbox``), each in its own thread, on real servers: the
weights after N steps streamed equal those resident bit for bit, and each stage's live parameter + gradient
bytes, read from the tensors at every unit boundary (``Streamer.trace``), stay within its budget plus one
unit. tests/test_pipeline_ray.py runs the same on Ray actors.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardps
from shardps.protos.syncspec import SyncSpec
from shardps.worker.datapath.shardpaths import ShardPaths
from shardps.worker.pipeline.partition import scatter, split_model
from shardps.worker.pipeline.plan import StepPlan, plan_step
from shardps.worker.pipeline.schedule import Kind
from shardps.worker.pipeline.stage import StageRuntime
from shardps.worker.pipeline.streamstage import StageOptimizer, StageStreamer
from shardps.worker.pipeline.streamweights import StreamWeights, check_stream, stage_stream
from shardps.worker.pipeline.walk import Mailbox, walk
from shardps.worker.pipeline.weights import StageWeights

WIDTH = 32
LAYER = (WIDTH * WIDTH + WIDTH) * 4  # bytes of one hidden Linear's weights
DEADLINE_S = 120.0  # a stage's step in these tests takes well under a second


class Swapped(nn.Module):
    """Two layers registered in the reverse of the order forward runs them: a plan taken from the
    registration order would prefetch the wrong one."""

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(WIDTH, WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.second(torch.tanh(self.first(x))))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    hidden = [m for _ in range(6) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    return nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), Swapped(), *hidden, nn.Linear(WIDTH, 4))


BALANCE = [7, 9]  # stage 0: 5 layers of WIDTH x WIDTH (2 in Swapped) and the first; stage 1: 4 and the last


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)


class Calls:
    """A stage's calls as the stage actor makes them: its weights side told of each task first."""

    def __init__(self, rt: StageRuntime, weights: StageWeights | StreamWeights) -> None:
        self.rt, self.weights = rt, weights

    def forward(self, mb: int, x: torch.Tensor, /) -> torch.Tensor:
        self.weights.before_forward(mb)
        return self.rt.forward(mb, x)

    def backward(self, mb: int, grad: torch.Tensor | None, target: torch.Tensor | None, weight: float,
                 next_mb: int | None, /) -> tuple[torch.Tensor | None, float]:
        if isinstance(self.weights, StreamWeights):
            self.weights.before_backward(mb)
        return self.rt.backward(mb, grad, target, weight, next_mb)


def run_stage(rt: StageRuntime, side: StageWeights | StreamWeights, step: int, plan: StepPlan,
              link: Mailbox[torch.Tensor], xs: list[torch.Tensor], ys: list[torch.Tensor], loss_fn: nn.Module) -> None:
    """One stage's part of a step, as ``StageActor.run_step`` runs it: its order of the plan, then its sync."""
    s = rt.index
    rt.begin_step(step, plan.chunks)
    rt.loss_fn = loss_fn
    side.begin_step()
    if isinstance(side, StreamWeights):
        side.begin_tasks(plan.orders[s])
    walk(plan, {s: Calls(rt, side)}, link, xs if s == 0 else None, ys if s == plan.last_stage else None)
    side.sync()


def train(addresses: list[str], *, schedule: str, checkpoint: str, sync: str = "bsp", steps: int = 3,
          stream: shardps.Stream | None = None, chunks: int = 3,
          after: Callable[[list[StageRuntime], list[StageWeights | StreamWeights]], None] | None = None,
          ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """``steps`` steps of the 2-stage pipeline on the servers at ``addresses``; the weights after them (from
    the servers when streamed) and, streamed, each stage's counters and largest traced live bytes."""
    whole = model()
    stages = split_model(copy.deepcopy(whole), BALANCE)
    spec = SyncSpec.parse(sync)
    clients = [shardps.connect(addresses, worker_id=s, num_workers=len(stages)) for s in range(len(stages))]
    loss_fn = nn.CrossEntropyLoss()
    try:
        rts = [StageRuntime(m, s, len(stages), checkpoint=checkpoint) for s, m in enumerate(stages)]
        sides: list[StageWeights | StreamWeights] = []
        for s, rt in enumerate(rts):
            if stream is None:
                def make(masters, client=clients[s]):
                    return shardps.DistributedOptimizer(masters, client, optimizer=shardps.optim.Adam(lr=1e-2),
                                                        sync=sync, provides_values=True)
                sides.append(StageWeights(rt, spec, 0, make))
            else:
                def make_streamed(module, st, client=clients[s]):
                    return StageOptimizer(module, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync,
                                          provides_values=True, stream=st)
                side = StreamWeights(rt, spec, stage_stream(stream, rt.module, ()), make_streamed)
                side.streamer.trace = []
                sides.append(side)
        with concurrent.futures.ThreadPoolExecutor(len(stages)) as pool:
            for step in range(steps):
                x, y = data(step)
                xs, ys = scatter(x, chunks), scatter(y, chunks)
                plan = plan_step(schedule, [len(c) for c in xs], len(stages), "mean")
                link = Mailbox[torch.Tensor](timeout=DEADLINE_S)

                args = (step, plan, link, xs, ys, loss_fn)
                for f in [pool.submit(run_stage, rts[s], sides[s], *args) for s in range(len(stages))]:
                    f.result(timeout=DEADLINE_S)
        if after is not None:
            after(rts, sides)
        weights: dict[str, torch.Tensor] = {}
        stats = []
        for side in sides:
            if isinstance(side, StreamWeights):
                assert side.streamer.held() == {}, "weights left gathered after the step"
                weights.update(side.state_dict())
                st = side.stats()
                st["traced_max"] = max(side.streamer.trace or [0])
                stats.append(st)
            else:
                weights.update(side.runtime.state_dict())
        return weights, stats
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("schedule, checkpoint, sync", [
    ("gpipe", "except_last", "bsp"),
    ("1f1b", "never", "bsp"),
    ("1f1b", "always", "bsp"),
    ("gpipe", "never", "every:2"),
])
@pytest.mark.parametrize("keep", ["server", "host"])
def test_streamed_stages_equal_resident_bit_for_bit(make_cluster, schedule, checkpoint, sync, keep):
    steps = 4 if sync.startswith("every") else 3
    resident, _ = train(make_cluster(2).addresses, schedule=schedule, checkpoint=checkpoint, sync=sync, steps=steps)
    streamed, stats = train(make_cluster(2).addresses, schedule=schedule, checkpoint=checkpoint, sync=sync,
                            steps=steps, stream=shardps.Stream(LAYER, keep=keep))
    assert resident.keys() == streamed.keys()
    for n in resident:
        assert torch.equal(streamed[n], resident[n]), f"{n}: streaming changed the weights"
    for s, st in enumerate(stats):
        assert st["peak_live_bytes"] == st["traced_max"]
        # The budget plus the unit running and its gradients, never the stage's size.
        assert st["peak_live_bytes"] <= st["max_live_bytes"] + 2 * st["largest_unit_bytes"], (s, st)
        assert st["peak_live_bytes"] < st["model_bytes"], (s, st)
        assert st["plan_misses"] == 0, (s, st)


def test_a_budget_of_the_whole_stage_pulls_each_weight_once_a_step(cluster2):
    """With room for every unit, a weight pulled for the first forward is found again by every later use."""
    steps = 2
    _, stats = train(cluster2.addresses, schedule="1f1b", checkpoint="except_last", steps=steps,
                     stream=shardps.Stream(1 << 30))
    for st in stats:
        assert st["pulled_bytes"] == steps * st["model_bytes"], st
    _, tight = train(cluster2.addresses, schedule="1f1b", checkpoint="except_last", steps=steps,
                     stream=shardps.Stream(0, prefetch=0))
    for st in tight:  # one unit at a time: pulled for every forward and backward of every micro-batch
        assert st["pulled_bytes"] > 3 * steps * st["model_bytes"], st
        assert st["peak_live_bytes"] <= 2 * st["largest_unit_bytes"], st


def test_the_plan_follows_the_forward_order_not_the_registration_order():
    """Swapped's second-registered layer runs first: the plan's forward slots name the units as called."""
    stage = split_model(model(), BALANCE)[0]
    streamer = StageStreamer(_NoServers(stage), stage, shardps.Stream(0))  # type: ignore[arg-type]
    names = [u.names[0] for u in streamer.units]
    streamer.order = [names.index("2.first.weight"), names.index("2.second.weight")]
    streamer.begin_step([(Kind.FORWARD, 0, True), (Kind.BACKWARD, 0, True)])
    slots = [(slot, streamer.units[k].names[0]) for slot, k in streamer._plan]
    assert slots == [(("f", 0), "2.first.weight"), (("f", 1), "2.second.weight"),
                     (("f", 2), "2.first.weight"), (("f", 3), "2.second.weight"),
                     (("b", 3), "2.second.weight"), (("b", 2), "2.first.weight")]
    streamer.close()


class _NoServers:
    """Just enough of an optimizer for a streamer that never pulls (the plan alone)."""

    def __init__(self, stage: nn.Module) -> None:
        self.params = dict(stage.named_parameters())
        self.client = type("C", (), {"versions": [0], "paths": ShardPaths(0, 0)})()
        self.sync = SyncSpec.parse("bsp")


def test_options_that_do_not_combine_are_refused_naming_both():
    servers, bsp = ["localhost:1"], SyncSpec.parse("bsp")
    stream = shardps.Stream(1 << 20)
    m = model()
    for kw, words in [({"servers": None}, ["servers="]),
                      ({"tensor_parallel": 2}, ["tensor_parallel=2"]),
                      ({"offload": "activations"}, ["offload='activations'"]),
                      ({"sync": SyncSpec.parse("asp")}, ["sync='asp'"]),
                      ({"sync": SyncSpec.parse("ssp:1")}, ["sync='ssp:1'"])]:
        args = {"servers": servers, "sync": bsp, "offload": None, "tensor_parallel": 1, "model": m, **kw}
        with pytest.raises(ValueError) as e:
            check_stream(stream, **args)
        assert "stream=" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ValueError, match="shardps.Stream"):
        check_stream(1 << 20, servers=servers, sync=bsp, offload=None, tensor_parallel=1, model=m)
    with pytest.raises(ValueError, match="not a module of the pipeline's model"):
        check_stream(shardps.Stream(1, modules=[nn.Linear(2, 2)]), servers=servers, sync=bsp, offload=None,
                     tensor_parallel=1, model=m)
    spec, names = check_stream(shardps.Stream(1, modules=[m[2]]), servers=servers, sync=bsp, offload=None,
                               tensor_parallel=1, model=m)
    assert names == ("2",) and spec.modules is None
    chosen = stage_stream(spec, split_model(m, BALANCE)[0], names).modules
    assert chosen is not None and [type(c).__name__ for c in chosen] == ["Swapped"]



def test_a_step_abandoned_midway_holds_nothing_after_and_evaluation_streams(cluster2):
    """A stage whose step failed after its first forward (its neighbour died, say): the next call that waits
    (an evaluation, ``state_dict``, ``close``) lets it go: nothing held, nothing left of the step's plan."""
    def abandon(rts: list[StageRuntime], sides: list[StageWeights | StreamWeights]) -> None:
        rt, side = rts[0], sides[0]
        assert isinstance(side, StreamWeights)
        x = data(0)[0][:4]
        before = rt.eval_forward(x)
        assert side.streamer.held() == {}
        plan = plan_step("gpipe", [4, 4], 2, "mean")
        rt.begin_step(99, 2)
        side.begin_step()
        side.begin_tasks(plan.orders[0])
        Calls(rt, side).forward(0, x)
        side.wait()
        assert side.streamer.held() == {} and not side.streamer.training
        assert torch.equal(rt.eval_forward(x), before)

    train(cluster2.addresses, schedule="gpipe", checkpoint="never", steps=1, stream=shardps.Stream(LAYER),
          after=abandon)


@pytest.mark.parametrize("argv, words", [
    (["--example", "digits", "--stream"], "--stream streams a pipeline's stages: use it with --example shakespeare"),
    (["--example", "shakespeare", "--stream", "--max-live-mb", "0"], "--max-live-mb must be > 0, got 0"),
])
def test_shardps_ray_refuses_stream_where_it_cannot_work(capsys, argv, words):
    from shardps.cli import main

    assert main(["ray", *argv]) == 2
    assert words in capsys.readouterr().err
