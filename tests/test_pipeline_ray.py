"""shardps.ray.Pipeline on a real Ray cluster: stages as actors, transparent, through the servers.

The servers are in this process (``LocalCluster``: real gRPC servers on loopback, which the stage actors of both
nodes reach): a server actor would cost its process's start, about 3 CPU-s, where what is tested is the
stages. Servers as actors are tested in tests/test_ray.py, and beside stages by the Shakespeare job below."""

from __future__ import annotations

import copy
import json
import os
import signal

import pytest
import ray
import torch
from ray.util.state import list_actors
from torch import nn

import shardps
import shardps.ray as sray
from shardps.deploy.ray.stage_actor import StageActor
from shardps.worker.pipeline.local import LocalPipeline
from shardps.worker.pipeline.partition import BalanceError
from tests.test_pipeline_ties import batch as tied_batch
from tests.test_pipeline_ties import lm_loss, tied_lm

pytestmark = pytest.mark.cluster


def mlp(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                         nn.Tanh(), nn.Linear(width, 4))


def data(n: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def one_process(model, x, y):
    ref = copy.deepcopy(model)
    nn.CrossEntropyLoss()(ref(x), y).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def assert_grads(got, expected):
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def _nodes() -> dict[str, str]:
    return {n["NodeID"]: ("second" if "offload" in n["Resources"] else "head") for n in ray.nodes() if n["Alive"]}


@pytest.mark.parametrize("schedule, checkpoint, offload", [("gpipe", "except_last", None),
                                                           ("1f1b", "never", "activations")])
def test_stages_on_two_nodes_give_one_process_gradients(ray_cluster, schedule, checkpoint, offload):
    """STRICT_SPREAD puts the two stages on the two nodes; the offload store lands on the offload node."""
    model, (x, y) = mlp(256), data(30)  # activations of 10 x 256: large enough to be offloaded
    with sray.Pipeline(model, balance=[3, 4], chunks=3, schedule=schedule, checkpoint=checkpoint, offload=offload,
                       strategy="STRICT_SPREAD") as pipe:
        loss = pipe.train_step(x, y, nn.CrossEntropyLoss())
        assert_grads(pipe.gradients(), one_process(model, x, y))
        assert loss == pytest.approx(float(nn.CrossEntropyLoss()(model(x), y).detach()), rel=1e-5)
        nodes = _nodes()
        assert sorted(nodes[n] for n in pipe.node_ids[0]) == ["head", "second"]
        if offload:
            assert nodes[pipe.store_info["node_id"]] == "second"
            assert pipe.offload_stats()[0]["stored_total"] > 0
            held = ray.get(pipe.store.info.remote(), timeout=60)  # the bytes went through the store's sockets
            assert held["peak_bytes"] > 0 and held["bundles"] == 0 and held["bytes"] == 0, held
        timeline = pipe.timeline()
        assert sorted(timeline) == [0, 1]
        assert {k for k, *_ in timeline[0]} >= {"F", "B"} and all(b >= a for _, _, a, b in timeline[0])
        torch.testing.assert_close(pipe.eval(x), LocalPipeline(model, balance=[3, 4], chunks=3).eval(x))


def test_four_stages_through_the_servers_equal_one_process_with_the_same_optimizer(ray_cluster):
    """bsp, 2 pipeline replicas x 4 stages, Adam on the servers: k steps equal k steps of torch's Adam on
    the whole batch in one process."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    with shardps.LocalCluster(2) as servers, \
            sray.Pipeline(model, balance=[2, 2, 2, 1], chunks=2, schedule="1f1b", servers=servers,
                          optimizer=shardps.optim.Adam(lr=1e-2), replicas=2, num_cpus=0.5) as pipe:
        for step in range(3):
            x, y = data(16, seed=step)
            loss = pipe.train_step(x, y, nn.CrossEntropyLoss())
            opt.zero_grad()
            ref_loss = nn.CrossEntropyLoss()(ref(x), y)
            ref_loss.backward()
            opt.step()
            assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5)
        got = pipe.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("schedule, replicas", [("gpipe", 1), ("1f1b", 2)])
def test_a_weight_tied_across_stages_is_one_tensor_on_the_servers(ray_cluster, schedule, replicas):
    """An embedding in the first stage and a head in the last share one weight (tests/test_pipeline_ties.py):
    both stages push their parts of its gradient under its one name, the servers add them (and average the
    replicas) and step it once a step. 3 Adam steps equal torch's Adam on the unsplit model."""
    model = tied_lm()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    with shardps.LocalCluster(2) as servers, \
            sray.Pipeline(model, balance=[2, 2], chunks=2, schedule=schedule, servers=servers, replicas=replicas,
                          optimizer=shardps.optim.Adam(lr=1e-2), num_cpus=0.5) as pipe:
        for step in range(3):
            x, y = tied_batch(seed=step)
            loss = pipe.train_step(x, y, lm_loss)
            opt.zero_grad()
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            opt.step()
            assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
        got = pipe.state_dict()
        with shardps.connect(servers.addresses) as c:
            c.attach()
            on_servers = c.pull()
    assert "3.weight" not in on_servers and set(on_servers) == {n for n, _ in ref.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(on_servers[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_under_asp_each_backward_runs_on_its_forwards_weights(ray_cluster):
    """The pull of step t lands while step t+1 runs (its first micro-batch starts on the old weights):
    recorded per micro-batch, every backward used the weight version its forward did."""
    model = mlp()
    with shardps.LocalCluster(1) as servers, \
            sray.Pipeline(model, balance=[3, 4], chunks=4, schedule="gpipe", checkpoint="always", servers=servers,
                          optimizer=shardps.optim.SGD(lr=0.05), sync="asp", weight_delay=1) as pipe:
        for step in range(4):
            pipe.train_step(*data(8, seed=step), nn.CrossEntropyLoss())
        versions = pipe.versions()
    for stage, records in versions.items():
        assert records and all(fwd == bwd for _, _, fwd, bwd in records), (stage, records)
        last = max(r[0] for r in records)
        mixed = {v for s, _, v, _ in records if s == last}
        assert len(mixed) == 2, (stage, records)  # micro-batch 0 on the old weights, the rest on the new


class DiesInStep1Microbatch2(StageActor):
    """Stage 1 of replica 0 kills its own process (SIGKILL) as the forward of step 1, micro-batch 2 starts
    (its input taken): a fault at an exact point, injected here, not shipped. Stage 0 then waits for its
    gradients and stage 2 for its outputs, over connections that close. (Ray workers import this module:
    the tests' cluster puts the repository on their PYTHONPATH.)"""

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        if (self.index, self.replica, self.rt.step, mb) == (1, 0, 1, 2):
            # Its word that it took this input (held back until the stage next waits: worker/pipeline/
            # socketlink.py) is out first: otherwise stage 0 would name micro-batch 1 as the last input
            # taken (a stage that dies mid-task is named "in micro-batch 1 or after it").
            link = self.link
            link._send_acks()
            with link._cond:
                assert link._cond.wait_for(lambda: not link._busy, 60)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(mb, x)


class PipelineWithAFault(sray.Pipeline):
    stage_actor = DiesInStep1Microbatch2


@pytest.mark.fault
def test_a_stage_that_dies_names_itself_and_the_pipeline_is_rebuilt_from_the_servers(ray_cluster):
    """Its neighbours notice at once (not at the step's deadline, 600 s here: the error would say so) and
    the driver names the dead stage and the micro-batch it had taken the input of."""
    model = mlp()
    with shardps.LocalCluster(2) as servers:
        pipe = PipelineWithAFault(model, balance=[3, 2, 2], chunks=3, servers=servers,
                                  optimizer=shardps.optim.SGD(lr=0.1))
        try:
            pipe.train_step(*data(9, seed=0), nn.CrossEntropyLoss())
            with pytest.raises(sray.PipelineError) as err:
                pipe.train_step(*data(9, seed=1), nn.CrossEntropyLoss())
            assert (err.value.stage, err.value.microbatch, err.value.kind) == (1, 2, "forward"), str(err.value)
            assert "step 1: stage 1 (replica 0) died in the forward of micro-batch 2" in str(err.value)
            with pytest.raises(sray.PipelineError, match="cannot run another step"):
                pipe.train_step(*data(9, seed=1), nn.CrossEntropyLoss())
        finally:
            pipe.close()
        with shardps.connect(servers.addresses) as c:
            c.attach()
            on_servers = c.pull()
        with sray.Pipeline(model, balance=[3, 2, 2], chunks=3, servers=servers,
                           optimizer=shardps.optim.SGD(lr=0.1)) as again:
            again.train_step(*data(9, seed=1), nn.CrossEntropyLoss())  # step 1 once more, from the servers' weights
            expected = copy.deepcopy(model)
            with torch.no_grad():
                for n, p in expected.named_parameters():
                    p.copy_(on_servers[n])
            x, y = data(9, seed=1)
            nn.CrossEntropyLoss()(expected(x), y).backward()
            assert_grads(again.gradients(), {n: p.grad for n, p in expected.named_parameters()})


class FailsInStep0Microbatch1Backward(StageActor):
    """Stage 2's backward of micro-batch 1 raises in step 0, once (the process lives on)."""

    raised = False

    def backward(self, mb, grad, target, weight, next_mb):
        if (self.index, self.rt.step, mb) == (2, 0, 1) and not self.raised:
            self.raised = True
            raise FloatingPointError("injected")
        return super().backward(mb, grad, target, weight, next_mb)


class PipelineWithAnError(sray.Pipeline):
    stage_actor = FailsInStep0Microbatch1Backward


@pytest.mark.fault
def test_a_stage_that_raises_ends_the_step_everywhere_and_the_next_step_runs(ray_cluster):
    """The failing stage closes its group: stages 0 and 1, waiting for its gradients, end at once (with a
    step deadline of 600 s the error would otherwise come then); the next step runs on a new group, with
    batches of another size (the headers carry the shapes), and its gradients are one process's."""
    model = mlp()
    with PipelineWithAnError(model, balance=[3, 2, 2], chunks=2, schedule="1f1b") as pipe:
        with pytest.raises(sray.PipelineError) as err:
            pipe.train_step(*data(8), nn.CrossEntropyLoss())
        assert (err.value.stage, err.value.microbatch, err.value.kind) == (2, 1, "backward"), str(err.value)
        assert str(err.value) == ("step 0: stage 2 (replica 0) failed in the backward of micro-batch 1: "
                                  "FloatingPointError: injected")
        for n in (5, 11):
            x, y = data(n, seed=n)
            pipe.train_step(x, y, nn.CrossEntropyLoss())
            assert_grads(pipe.gradients(), one_process(model, x, y))


def test_bad_input_is_refused_before_any_actor_starts(ray_cluster):
    def stage_actors() -> int:
        return len([a for a in list_actors(address=ray_cluster.address, filters=[("state", "=", "ALIVE")])
                    if a.class_name == "StageActor"])

    before = stage_actors()
    with pytest.raises(BalanceError, match=r"module: 7, sum of balance: 6"):
        sray.Pipeline(mlp(), balance=[3, 3], chunks=2)
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        sray.Pipeline(mlp(), balance=[3, 4], chunks=0)
    with pytest.raises(ValueError, match="step_timeout must be > 0 seconds, got 0"):
        sray.Pipeline(mlp(), balance=[3, 4], chunks=2, step_timeout=0)
    with pytest.raises(ValueError, match=r"0.weight is tied across stages \(stage 0 \(0.weight\) and stage 1 "
                                         r"\(3.weight\)\): a tied weight needs a barrier sync mode"):
        sray.Pipeline(tied_lm(), balance=[2, 2], chunks=2, servers=["127.0.0.1:1"], sync="asp")
    pipe = sray.Pipeline(mlp(), balance=[3, 4], chunks=4)
    with pytest.raises(ValueError, match="batch of 2 samples cannot be cut into 4 micro-batches"):
        pipe.train_step(*data(2), nn.CrossEntropyLoss())

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    bad = sray.Pipeline(nn.Sequential(nn.Linear(8, 8), Pair(), nn.Linear(8, 4)), balance=[2, 1], chunks=2)
    with pytest.raises(TypeError, match="stage 0 returned tuple, not a tensor"):
        bad.train_step(*data(4), nn.CrossEntropyLoss())
    assert stage_actors() == before
    pipe.close()
    bad.close()


def deep(width: int = 32) -> nn.Sequential:
    """8 hidden layers: with balance [10, 9] each stage holds 4 of them and one small one."""
    torch.manual_seed(0)
    hidden = [m for _ in range(8) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), *hidden, nn.Linear(width, 4))


def _train(stream, schedule: str, checkpoint: str, sync: str, steps: int):
    with shardps.LocalCluster(2) as servers, \
            sray.Pipeline(deep(), balance=[10, 9], chunks=3, schedule=schedule, checkpoint=checkpoint,
                          servers=servers, optimizer=shardps.optim.Adam(lr=1e-2), num_cpus=0.5, sync=sync,
                          stream=stream) as pipe:
        losses = [pipe.train_step(*data(12, seed=step), nn.CrossEntropyLoss()) for step in range(steps)]
        stats = pipe.stream_stats() if stream is not None else {}
        if stream is not None:
            with pytest.raises(RuntimeError, match="keeps no gradients"):
                pipe.gradients()
        return pipe.state_dict(), losses, pipe.eval(data(6, seed=9)[0]), stats


# One case on actors (the most involved: 1F1B, recomputation, every:2), 25 s of the Ray tests' serial time
# each; the schedules, recompute modes, syncs and keeps are all compared bit for bit on real servers in
# tests/test_stream_pipeline.py, whose stages run the same StageStreamer in threads.
@pytest.mark.parametrize("schedule, checkpoint, sync", [("1f1b", "always", "every:2")])
def test_streamed_stages_train_bit_for_bit_as_resident_within_their_budget(ray_cluster, schedule, checkpoint, sync):
    """Pipeline(stream=): each stage holds at most its budget plus one unit and its gradients (its own
    counters), and after 3 steps (every:2: 4) the weights equal the resident pipeline's bit for bit."""
    layer, steps = (32 * 32 + 32) * 4, 4 if sync.startswith("every") else 3
    resident, r_losses, r_eval, _ = _train(None, schedule, checkpoint, sync, steps)
    streamed, s_losses, s_eval, stats = _train(shardps.Stream(layer), schedule, checkpoint, sync, steps)
    assert s_losses == r_losses
    assert resident.keys() == streamed.keys()
    for n in resident:
        assert torch.equal(streamed[n], resident[n]), f"{n}: streaming changed the weights"
    assert torch.equal(s_eval, r_eval)
    assert sorted(stats) == [0, 1]
    for s, st in stats.items():
        assert st["max_live_bytes"] == layer and st["steps"] == steps, st
        assert 0 < st["peak_live_bytes"] <= layer + 2 * st["largest_unit_bytes"] < st["model_bytes"], (s, st)
        assert st["pulled_bytes"] > 3 * st["model_bytes"], (s, st)  # pulled again for each micro-batch
        assert st["plan_misses"] == 0, (s, st)


def test_streamed_pipeline_refuses_what_does_not_combine(ray_cluster):
    stream = shardps.Stream(1 << 20)
    with pytest.raises(ValueError, match="stream= needs servers="):
        sray.Pipeline(deep(), balance=[10, 9], chunks=2, stream=stream)
    servers = ["127.0.0.1:1"]  # refused before anything connects
    with pytest.raises(ValueError, match=r"stream= with offload='activations' is not supported"):
        sray.Pipeline(deep(), balance=[10, 9], chunks=2, stream=stream, servers=servers, offload="activations")
    with pytest.raises(ValueError, match=r"stream= with sync='asp' is not supported"):
        sray.Pipeline(deep(), balance=[10, 9], chunks=2, stream=stream, servers=servers, sync="asp")
    with pytest.raises(ValueError, match=r"stream= with tensor_parallel=2 is not supported"):
        sray.Pipeline(deep(), balance=[10, 9], chunks=2, stream=stream, servers=servers, tensor_parallel=2,
                      tp_plan={"2": "column"})


def test_shakespeare_runs_as_a_ray_job(ray_cluster):
    """`shardps ray --example shakespeare` as a `ray job submit` entrypoint: a char-GPT in 2 stages,
    Adafactor on 2 servers; a short run (the full one, with figures, is in docs/pipeline.md)."""
    from tests.test_ray import _submit

    p = _submit(ray_cluster, ["shardps", "ray", "--example", "shakespeare", "--stages", "2", "--chunks", "4",
                              "--servers", "2", "--steps", "30", "--dim", "64", "--samples", "1",
                              "--sample-length", "40", "--json"])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"train_loss"')]
    assert p.returncode == 0 and lines, p.stdout[-4000:] + p.stderr[-2000:]
    out = json.loads(lines[-1])
    assert out["steps"] == 30 and out["stages"] == 2 and out["optimizer"] == "adafactor"
    assert out["initial_val_loss"] > 4.0 and out["val_loss"] < out["initial_val_loss"] - 0.8, out
    assert out["tokens_per_second"] > 0 and len(out["samples"]) == 1 and len(out["samples"][0]) == 40
    assert len(out["stage_nodes"]) == 2 and len(out["server_nodes"]) == 2
