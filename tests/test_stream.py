"""Streamed weights (``DistributedOptimizer(stream=shardps.Stream(...))``) change where bytes are, never the arithmetic.

Each case trains the same model twice on fresh clusters, resident and
streamed, and the weights must be bitwise equal after the last step (two
workers under bsp: a shard's sum of two gradients does not depend on their
arrival order). The budget cases count the live parameter + gradient bytes
at every module boundary (``Streamer.trace``).
"""

from __future__ import annotations

import copy
import mmap
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import shardps
from shardps.protos import shm
from tests.helpers import run_workers

BATCH = 8


class Mlp(nn.Module):
    def __init__(self, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.first = nn.Linear(10, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.last = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        for h in self.hidden:
            x = torch.tanh(h(x))
        return self.last(x)


class Reordered(nn.Module):
    """Registered last layer first: prefetching in named_parameters() order would pull the wrong unit."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 5)
        self.mid = nn.Linear(16, 16)
        self.inp = nn.Linear(10, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class TiedLM(nn.Module):
    """Embedding and LM head share one weight: fetched for each use, its gradient pushed once (summed)."""

    def __init__(self, vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))))


MODELS = {"mlp": Mlp, "reordered": Reordered, "tied": TiedLM}


def batch(name: str, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + step)
    if name == "tied":
        return torch.randint(0, 12, (BATCH,), generator=g), torch.randint(0, 12, (BATCH,), generator=g)
    return torch.randn(BATCH, 10, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def train(addresses, model_name: str, workers: int, sync: str, steps: int, stream=None, optimizer=None,
          shm: bool = True, **kw):
    torch.manual_seed(0)
    base = MODELS[model_name]()

    def worker(k: int):
        model = copy.deepcopy(base)
        client = shardps.connect(addresses, worker_id=k, num_workers=workers, part_bytes=512, chunk_bytes=1024,
                                 shm=shm)
        try:
            opt = shardps.DistributedOptimizer(model, client, sync=sync, stream=stream,
                                               optimizer=optimizer or shardps.optim.Adam(lr=1e-2), **kw)
            for step in range(steps):
                x, y = batch(model_name, step, k)
                opt.scale(nn.functional.cross_entropy(model(x), y)).backward()
                opt.step()
                opt.zero_grad()
            if opt.stream is not None:
                assert opt.stream.held() == {}, "weights left gathered after the loop"
                out = opt.stream.weights()  # the streamed model holds none: the servers' for the next step
                out["misses"] = torch.tensor(opt.stream.misses_after_first)
                return out
            return {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            client.close()

    return run_workers(worker, workers)


CASES = [
    ("mlp", "bsp", 2, "adam", None),
    ("mlp", "every:3", 2, "adam", None),
    ("mlp", "bsp", 2, "adafactor", None),
    ("mlp", "bsp", 2, "adam", torch.bfloat16),
    ("mlp", "bsp", 2, "adam", "loss_scaling"),
    ("tied", "bsp", 2, "adam", None),
    ("reordered", "bsp", 2, "adam", None),
    ("mlp", "asp", 1, "adam", None),
    ("mlp", "ssp:1", 1, "adam", None),
]


@pytest.mark.parametrize("model_name, sync, workers, opt_name, grad_dtype", CASES)
def test_streamed_equals_resident(make_cluster, model_name, sync, workers, opt_name, grad_dtype):
    steps = 6 if sync.startswith("every") else 3
    optimizer = shardps.optim.Adafactor() if opt_name == "adafactor" else None
    kw = {"loss_scaling": True, "grad_dtype": torch.float16} if grad_dtype == "loss_scaling" else \
        {"grad_dtype": grad_dtype} if grad_dtype is not None else {}
    resident = train(make_cluster(2).addresses, model_name, workers, sync, steps, optimizer=optimizer, **kw)
    streamed = train(make_cluster(2).addresses, model_name, workers, sync, steps, optimizer=optimizer,
                     stream=shardps.Stream(1 << 20), **kw)
    torch.manual_seed(0)
    names = [n for n, _ in MODELS[model_name]().named_parameters()]
    for k in range(workers):
        for n in names:
            assert torch.equal(streamed[k][n], resident[k][n]), f"worker {k}, {n}: streaming changed the weights"
    if model_name == "reordered":
        # After the first step each unit's pull was started by the slot before it (the forward order recorded),
        # except the step's first: in registration order the prefetch would miss every unit.
        assert all(int(s["misses"]) == steps - 1 for s in streamed), [int(s["misses"]) for s in streamed]


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_weights_freed_and_pulled_again_each_step_train_as_resident_on_either_path(make_cluster, shm):
    """A budget of about one layer: every unit is freed (its storage resized to nothing) and pulled again each
    step. On a data connection the pulls are read straight into the parameters' storage, which must stay
    resizable (``Tensor.numpy()`` on it would mark it not, and the next free would fail)."""
    resident = train(make_cluster(2).addresses, "mlp", 2, "bsp", 3)
    streamed = train(make_cluster(2).addresses, "mlp", 2, "bsp", 3, stream=shardps.Stream((24 * 24 + 24) * 4),
                     shm=shm)
    for k in range(2):
        for n, w in resident[k].items():
            assert torch.equal(streamed[k][n], w), f"worker {k}, {n}"


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_several_pulls_in_flight_to_one_shard_train_as_resident(make_cluster, shm):
    """``prefetch=3``: a shard is asked for the next units' weights before the first answer is read. On one
    host each Pull has a pull segment of its own: with one for all, the shard wrote the next unit's weights over
    those not yet read, and the model trained on wrong weights without a word."""
    resident = train(make_cluster(2).addresses, "mlp", 2, "bsp", 3)
    streamed = train(make_cluster(2).addresses, "mlp", 2, "bsp", 3, stream=shardps.Stream(1 << 20, prefetch=3),
                     shm=shm)
    for k in range(2):
        for n, w in resident[k].items():
            assert torch.equal(streamed[k][n], w), f"worker {k}, {n}"


def test_live_bytes_stay_under_the_budget_at_every_boundary(cluster2):
    torch.manual_seed(0)
    model = Mlp(width=32, depth=6)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    layer = (32 * 32 + 32) * 4
    budget = 2 * layer
    with shardps.connect(cluster2.addresses, part_bytes=2048) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1),
                                           stream=shardps.Stream(budget, prefetch=2))
        st = opt.stream
        assert st is not None and st.held() == {}
        st.trace = []
        for step in range(3):
            x, y = batch("mlp", step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert st.held() == {}
        assert st.trace and max(st.trace) == st.peak_live_bytes
        bound = budget + 2 * st.largest_unit_bytes  # a unit must be whole to run, with its gradients
        assert st.peak_live_bytes <= bound, (st.peak_live_bytes, bound)
        assert st.peak_live_bytes < model_bytes / 2, (st.peak_live_bytes, model_bytes)
        st.reset_peak()
        assert st.peak_live_bytes == 0


def _held(segment: shm.Segment) -> int:
    """The bytes of a segment in memory (tmpfs counts the file's pages as they are written or given back)."""
    return os.stat(Path("/dev/shm") / segment.name).st_blocks * 512


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine: the same-host path is off")
def test_a_streamed_workers_pull_segments_keep_what_a_pull_needs_not_its_share_of_the_model(cluster2):
    """A pull segment is as large as the worker's share of the model on its shard, and a whole pull (the
    weights of the model, for a checkpoint) writes all of it. A streamed worker pulls a budget's worth at a
    time: once a pull is read, the pages past that (``Streamer.pull_keep_bytes``) are given back. A resident
    worker keeps them (every step writes them again)."""
    torch.manual_seed(0)
    model = Mlp(width=256, depth=10)
    layer = (256 * 256 + 256) * 4
    with shardps.connect(cluster2.addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1),
                                           stream=shardps.Stream(2 * layer))
        st = opt.stream
        assert st is not None
        keep = st.pull_keep_bytes
        links = [link for link in client.shm_links if link is not None]
        assert len(links) == 2 and all(link.pull.size > keep + 4 * mmap.PAGESIZE for link in links)

        def kept() -> list[bool]:  # every pull segment of each shard (one per Pull in flight)
            return [all(_held(seg) <= keep + 64 * len(link.parts) + mmap.PAGESIZE for seg in link.pull_segments)
                    for link in links]

        for step in range(2):
            x, y = batch("mlp", step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert kept() == [True, True], step
        whole = st.weights()  # one pull of the whole model: its pull segment written to its end
        assert sum(w.numel() for w in whole.values()) == sum(p.numel() for p in model.parameters())
        assert kept() == [True, True]
    torch.manual_seed(0)
    model = Mlp(width=256, depth=10)
    with shardps.connect(cluster2.addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1))
        x, y = batch("mlp", 0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # its pull of every weight, through the segments
        assert all(max(_held(seg) for seg in link.pull_segments) >= link.pull.size - mmap.PAGESIZE
                   for link in client.shm_links if link)


def test_named_units_and_an_evaluation_hold_nothing_after(cluster2):
    """Units named by the user (each hidden layer with its activation, in a Sequential); an evaluation forward
    (no autograd) between steps keeps nothing once it returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 24), nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24)),
                          nn.Linear(24, 5))
    with shardps.connect(cluster2.addresses, part_bytes=512) as client:
        opt = shardps.DistributedOptimizer(model, client, stream=shardps.Stream(1 << 20, modules=[model[1]]))
        st = opt.stream
        assert st is not None and [len(u.names) for u in st.units] == [2, 4, 2]
        for step in range(2):
            x, y = batch("mlp", step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            with torch.no_grad():
                out = model(x)
            assert st.held() == {} and out.shape == (BATCH, 5)
        assert st.misses_after_first == 1  # the second step: only its first unit was not prefetched


def test_a_rejoin_registers_shapes_only_and_goes_on(cluster2):
    """After an eviction the optimizer registers again (``_join``): a streamed worker's weights are released,
    so it sends shapes (meta tensors), not values, and the next forward pulls the job's weights."""
    torch.manual_seed(0)
    model = Mlp()
    with shardps.connect(cluster2.addresses, part_bytes=512) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1),
                                           stream=shardps.Stream(1 << 20))
        x, y = batch("mlp", 0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        before = opt.stream.weights()
        opt._join()  # what _push_failed does on REJOIN
        assert opt.stream.held() == {}
        assert all(torch.equal(w, before[n]) for n, w in opt.stream.weights().items())  # the job's, unchanged
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.pushes == 2 and opt.stream.held() == {}


def test_keep_host_brings_backward_weights_from_the_host(cluster2):
    torch.manual_seed(0)
    model = Mlp()
    with shardps.connect(cluster2.addresses, part_bytes=512) as client:
        opt = shardps.DistributedOptimizer(model, client, stream=shardps.Stream(4096, keep="host"))
        st = opt.stream
        assert st is not None
        for step in range(2):
            x, y = batch("mlp", step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        units = len(st.units)
        assert st.pulls == 2 * units  # forward only: backward copies from the host
        assert st.peak_host_bytes == st.model_bytes and st.host_bytes() == 0


def test_close_mid_step_holds_nothing(cluster2):
    torch.manual_seed(0)
    model = Mlp()
    with shardps.connect(cluster2.addresses, part_bytes=512) as client:
        opt = shardps.DistributedOptimizer(model, client, stream=shardps.Stream(1 << 20, prefetch=3))
        x, y = batch("mlp", 0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # the forward's order is recorded: the next prefetches
        loss = nn.functional.cross_entropy(model(x), y)
        assert opt.stream is not None and opt.stream.held()  # the backward's first units, prefetched
        opt.stream.close()
        assert opt.stream.held() == {}
        del loss


@pytest.mark.parametrize("where", ["forward", "push"])
def test_rollback_mid_stream_holds_nothing(make_cluster, tmp_path, where):
    """``forward``: the job rolls back before the step, its first pull meets it; ``push``: after the forward
    (keep="host": backward pulls nothing), the step's push stream, open since backward, meets it."""
    cluster = make_cluster(2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    torch.manual_seed(0)
    model = Mlp()
    with shardps.connect(cluster.addresses, part_bytes=512) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp",
                                           stream=shardps.Stream(1 << 20, keep="host" if where == "push" else "server"))
        x, y = batch("mlp", 0, 0)
        for _ in range(4):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        with pytest.raises(shardps.RolledBack) as e:
            if where == "forward":
                cluster.stores[1].job.recovering = True  # shard 1 restarted from its checkpoint at 4
            loss = nn.functional.cross_entropy(model(x), y)
            cluster.stores[1].job.recovering = True
            loss.backward()
            opt.step()
        assert e.value.step == 4
        assert opt.stream is not None and opt.stream.held() == {}
        assert all(p.grad is None for p in model.parameters())
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # and training goes on
        assert [s["version"] for s in client.stats()] == [5, 5]


@pytest.mark.parametrize("kw, said", [
    ({"max_live_bytes": -1}, "max_live_bytes must be >= 0, got -1"),
    ({"max_live_bytes": 1.5}, "max_live_bytes must be an int"),
    ({"max_live_bytes": 10, "keep": "disk"}, "keep must be one of ('server', 'host'), got 'disk'"),
    ({"max_live_bytes": 10, "prefetch": -2}, "prefetch must be an int >= 0, got -2"),
])
def test_bad_settings_are_named(kw, said):
    with pytest.raises(ValueError) as e:
        shardps.Stream(**kw)
    assert said in str(e.value)


def test_stream_needs_the_model_and_not_overlap(cluster2):
    model = Mlp()
    with shardps.connect(cluster2.addresses) as client:
        with pytest.raises(ValueError, match="needs the model"):
            shardps.DistributedOptimizer(model.named_parameters(), client, stream=shardps.Stream(100))
        with pytest.raises(ValueError, match="overlap=True is not supported"):
            shardps.DistributedOptimizer(model, client, stream=shardps.Stream(100), overlap=True)
