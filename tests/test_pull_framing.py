"""Large Pulls are framed outside the shard's lock while pushes go on, over real gRPC servers.

SGD with lr=1 and gradients of ones: after version v of a shard each of its
weights is exactly -v, so a Pull that mixed two versions shows up as a
tensor that is not constant, or not at the version its responses carry.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

import shardps
from shardps.server.datapath import reader as pullcache
from tests.helpers import run_workers

STEPS = 8
SHAPES = {"a": (512, 512), "b": (1024, 256), "c": (300_001,)}  # 1 MiB, 1 MiB, 1.2 MB: many 64 KiB chunks


def _ones() -> dict[str, torch.Tensor]:
    return {n: torch.ones(s) for n, s in SHAPES.items()}


def _constant(weights: dict[str, torch.Tensor], value: float) -> bool:
    return all(torch.equal(w, torch.full(SHAPES[n], value)) for n, w in weights.items())


@pytest.mark.fault
def test_a_push_during_a_pulls_framing_waits_for_it(make_cluster, monkeypatch):
    """The framing thread stops after its first response until the other worker's push has reached the
    shard (waiting for the framing, or, were it not to wait, applied): the Pull is still all version 1."""
    from shardps.worker.datapath.dataconn import ConnPath

    # The Pull names no segment: its bytes in its answer's messages, framed by frame_items (a tensor-parallel
    # rank's Pull is answered so).
    monkeypatch.setattr(ConnPath, "take_pull", lambda self, nbytes: "")
    cluster = make_cluster(1)
    st = cluster.stores[0]
    st.reader.frame_inline_bytes = 0
    paused, real = threading.Event(), pullcache.frame_items

    def items(*args, **kw):
        for i, item in enumerate(real(*args, **kw)):
            if i == 1 and not paused.is_set():
                paused.set()
                with st._cond:
                    assert st._cond.wait_for(lambda: st.reader.writers_waiting or st.job.version > 1, timeout=60)
            yield item

    monkeypatch.setattr(pullcache, "frame_items", items)
    kw = dict(chunk_bytes=64 << 10, shm=False)
    with shardps.connect(cluster.addresses, 0, 2, **kw) as c0, shardps.connect(cluster.addresses, 1, 2, **kw) as c1:
        c0.register({n: torch.zeros(s) for n, s in SHAPES.items()}, shardps.optim.SGD(lr=1.0), sync="asp")
        c1.register({n: torch.zeros(s) for n, s in SHAPES.items()}, shardps.optim.SGD(lr=1.0), sync="asp")
        c0.push(_ones(), step=0)
        pulled: list = []
        puller = threading.Thread(target=lambda: pulled.append(c0.pull()))
        puller.start()
        assert paused.wait(60)
        c1.push(_ones(), step=0)  # returns once applied: after the framing let go of the weights
        puller.join(60)
        assert not puller.is_alive() and pulled
        assert c0.versions == [1] and _constant(pulled[0], -1.0), {n: w.unique()[:4] for n, w in pulled[0].items()}
        assert _constant(c0.pull(), -2.0) and c0.versions == [2]


@pytest.mark.fault
def test_asp_workers_pulling_and_pushing_at_once_see_whole_versions(cluster2):
    for st in cluster2.stores:
        st.reader.frame_inline_bytes = 0
    zeros = {n: torch.zeros(s) for n, s in SHAPES.items()}

    def worker(k: int) -> list[tuple[dict[str, int], dict[str, torch.Tensor]]]:
        client = shardps.connect(cluster2.addresses, worker_id=k, num_workers=2, chunk_bytes=64 << 10,
                                 part_bytes=2 << 20, shm=False)
        try:
            client.register(zeros, shardps.optim.SGD(lr=1.0), sync="asp")
            owner = {p.name: shard for shard in range(client.num_shards) for p in client.shard_map.parts_for(shard)}
            seen = []
            for step in range(STEPS):
                client.push(_ones(), step=step)
                weights = client.pull()
                seen.append(({n: client.versions[owner[n]] for n in SHAPES}, weights))
            return seen
        finally:
            client.close()

    results = run_workers(worker, 2)
    for k, seen in enumerate(results):
        for versions, weights in seen:
            for n, w in weights.items():
                assert torch.equal(w, torch.full(SHAPES[n], -float(versions[n]))), \
                    f"worker {k}: {n} pulled at version {versions[n]} holds {w.unique()[:5].tolist()}"
    for st in cluster2.stores:  # a framing thread (or a sent answer) ends its read just after the worker has it
        with st._cond:
            assert st._cond.wait_for(lambda st=st: st.reader.reading == 0, 30), st.reader.reading
    with shardps.connect(cluster2.addresses, shm=False) as client:
        client.attach()
        assert _constant(client.pull(), -2.0 * STEPS)


@pytest.mark.fault
def test_a_pull_that_fails_mid_answer_is_asked_again_whole_never_a_mix_of_versions(make_cluster, monkeypatch):
    """A Pull's answer fails after tensor "a" came whole (UNAVAILABLE, as a connection lost mid-answer), and
    before the retry the other worker's push makes version 2. No tensor of a shard is complete (``wait``)
    before its whole answer is in, so the retry asks for all three again and all three are version 2's: not
    "a" at version 1 beside "b" and "c" at 2, under a shard version that names one of them."""
    from shardps.worker.datapath.reach import StatusError

    cluster = make_cluster(1)
    kw = dict(chunk_bytes=64 << 10, shm=False)
    with shardps.connect(cluster.addresses, 0, 2, **kw) as c0, shardps.connect(cluster.addresses, 1, 2, **kw) as c1:
        zeros = {n: torch.zeros(s) for n, s in SHAPES.items()}
        c0.register(zeros, shardps.optim.SGD(lr=1.0), sync="asp")
        c1.register(zeros, shardps.optim.SGD(lr=1.0), sync="asp")
        c0.push(_ones(), step=0)
        real, asked = c0.transport.pull, []
        monkeypatch.setattr(c0.paths, "usable", lambda shard: False)  # every Pull a call through the transport

        def pull(shard, req, **kw):
            asked.append(list(req.names))
            answer = list(real(shard, req, **kw))  # the whole answer read: the server is done with it
            if len(asked) > 1:
                yield from answer
                return
            yield from (r for r in answer if r.chunk.name == "a")
            c1.push(_ones(), step=0)  # version 2, before the retry
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the answer broke off after 'a'")

        monkeypatch.setattr(c0.transport, "pull", pull)
        pulled = c0.pull()
        assert asked == [["a", "b", "c"], ["a", "b", "c"]]
        assert _constant(pulled, -2.0) and c0.versions == [2]
