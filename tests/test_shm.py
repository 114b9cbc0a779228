"""The same-host fast path: tensor bytes through shared memory, frames on the data connection carrying where
they lie.

Exact against the bytes in the frames (the same bytes, another road), refused cleanly when a
request names a bad segment, off where the probe fails, and the segments
gone when the client closes.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import grpc
import pytest
import torch

import shardps
from shardps.protos import shm
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.frames import FrameStub
from tests.helpers import path_model, train_over_paths

pytestmark = pytest.mark.skipif(
    not shm.available(),
    reason="no writable /dev/shm on this machine: the same-host path is off")

STEPS = 3


@pytest.mark.parametrize("opt_kw", [dict(sync="bsp"), dict(sync="asp"),
                                    dict(sync="bsp", overlap=True, bucket_bytes=3000),
                                    dict(sync="every:2", grad_dtype=torch.bfloat16, pull_dtype=torch.bfloat16),
                                    dict(sync="bsp", overlap=True, bucket_bytes=3000, grad_dtype=torch.bfloat16,
                                         pull_dtype=torch.bfloat16), dict(sync="bsp", push_window=1)],
                         ids=["bsp", "asp", "bsp-overlap", "every2-bf16", "bsp-overlap-bf16", "bsp-window1"])
def test_shared_memory_gives_the_weights_the_bytes_in_the_frames_give(make_cluster, opt_kw):
    over_frames = train_over_paths(make_cluster(2).addresses, shm=False, **opt_kw)
    over_shm = train_over_paths(make_cluster(2).addresses, shm=True, **opt_kw)
    for k in range(2):
        assert over_frames[k][0] == ["ConnPath"] * 2 and over_shm[k][0] == ["ShmConnPath"] * 2
        if opt_kw["sync"] == "asp":
            continue  # two asp workers' gradients apply in arrival order: compared single-worker below
        for n, w in over_frames[k][1].items():
            assert torch.equal(over_shm[k][1][n], w), f"worker {k}, {n}"


def test_asp_one_worker_exact(make_cluster):
    def run(use_shm):
        model = path_model()
        with shardps.connect(make_cluster(2).addresses, part_bytes=1024, shm=use_shm) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync="asp")
            for step in range(STEPS):
                x = torch.randn(8, 10, generator=torch.Generator().manual_seed(step))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b = run(False), run(True)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_segments_are_removed_when_the_client_closes(cluster2):
    mine = f"shardps-{os.getpid()}-*"  # other processes on this machine may hold segments of their own
    before = set(Path("/dev/shm").glob(mine))
    client = shardps.connect(cluster2.addresses)
    client.register({"w": torch.randn(100)}, shardps.optim.SGD(lr=0.1))
    names = {link.push.name for link in client.shm_links if link} | {link.pull.name for link in client.shm_links
                                                                      if link}
    assert len(names) == 4 and all((Path("/dev/shm") / n).exists() for n in names)
    client.close()
    assert not any((Path("/dev/shm") / n).exists() for n in names)
    assert set(Path("/dev/shm").glob(mine)) <= before


def test_release_gives_the_pages_of_a_range_back_and_keeps_the_rest():
    page = mmap.PAGESIZE
    seg = shm.create("release-test", 10 * page)
    try:
        path = Path("/dev/shm") / seg.name
        seg.view(0, 10 * page)[:] = b"\xff" * (10 * page)
        assert path.stat().st_blocks * 512 >= 10 * page
        # from the first page boundary at or after the offset, to the end of the page holding the last byte
        assert seg.release(100, 5 * page) == 4 * page + 100
        assert path.stat().st_blocks * 512 <= 5 * page
        data = bytes(seg.view(0, 10 * page))
        assert data[:page] == b"\xff" * page and data[page : 6 * page] == bytes(5 * page)
        assert data[6 * page :] == b"\xff" * (4 * page)
        assert seg.release(page + 1, page - 2) == 0  # no page wholly inside, and none starts in it
        with pytest.raises(ValueError, match="outside its"):
            seg.release(9 * page, 2 * page)
        seg.view(page, 4)[:] = b"abcd"  # written again: a fresh page
        assert bytes(seg.view(page, 4)) == b"abcd"
    finally:
        seg.close()
    assert seg.release(0, 0) == 0


def test_a_shard_unmaps_the_segments_a_worker_removed_before_it_maps_another():
    """A pull segment the worker gave up (the shard may have written it) is removed by the worker; the shard's
    mapping, which holds its pages, goes the next time that worker names a segment the shard has not mapped."""
    from shardps.server.datapath.shm import SegmentCache

    cache = SegmentCache()
    kept, given_up, other, later = (shm.create(f"prune-{k}", 4096) for k in ("kept", "gone", "other", "later"))
    try:
        for seg in (kept, given_up):
            cache.get(1, seg.name)
        cache.get(2, other.name)
        given_up.close()  # the worker's: the file is removed (the shard's mapping stays, for now)
        other.close()  # another worker's: not this worker's to prune
        assert cache.get(1, kept.name).name == kept.name  # a hit prunes nothing
        assert len(cache._segments) == 3
        cache.get(1, later.name)  # a miss: worker 1's removed segment is unmapped first
        assert set(cache._segments) == {kept.name, other.name, later.name}
    finally:
        cache.close()
        for seg in (kept, later):
            seg.close()


def test_the_probe_reads_only_the_token_it_was_given():
    seg, token = shm.probe()
    try:
        assert shm.read_probe(seg.name, token)
        assert not shm.read_probe(seg.name, b"x" * 16)
        assert not shm.read_probe("shardps-missing-segment", token)
        assert not shm.read_probe("../etc/passwd", token)
    finally:
        seg.close()


@pytest.fixture
def one_shard(make_cluster):
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses)
    client.register({"w": torch.randn(4, 5)}, shardps.optim.SGD(lr=0.5), sync="bsp")
    stub = FrameStub(cluster.addresses[0])  # Push and Pull as a data connection's frames
    yield cluster.stores[0], stub, client
    stub.close()
    client.close()


def _push(stub, segment, offset, nbytes):
    reqs = [ps_pb2.PushRequest(worker_id=0, step=0, shm=segment, chunk=ps_pb2.Chunk(
        name="w", offset=0, dtype=ps_pb2.FLOAT32, shape=[4, 5], shm_offset=offset, shm_bytes=nbytes))]
    return stub.Push(iter(reqs), timeout=10)


def test_bad_segments_are_refused_and_change_nothing(one_shard):
    store, stub, client = one_shard
    link = client.shm_links[0]
    assert link is not None
    before = store.state_hash()
    cases = [("shardps-no-such-segment", 0, 80, ["shardps-no-such-segment", "cannot be opened"]),
             ("../../etc/passwd", 0, 80, ["expected 'shardps-'"]),
             (link.push.name, link.push.size - 8, 80, [link.push.name, "outside its"]),
             (link.push.name, 0, 40, ["'w'", "covers 10 of the 20 elements"])]
    for name, offset, nbytes, fragments in cases:
        with pytest.raises(grpc.RpcError) as err:
            _push(stub, name, offset, nbytes)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        for f in fragments:
            assert f in err.value.details(), (f, err.value.details())
    assert store.state_hash() == before and store.job.pushes_total == 0


def test_a_pull_into_a_small_segment_is_refused(one_shard):
    store, stub, client = one_shard
    small = shm.create("test-small", 16)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(ps_pb2.PullRequest(worker_id=0, shm=small.name), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert small.name in err.value.details() and "holds 16 bytes" in err.value.details()
    finally:
        small.close()


def test_a_pull_through_shared_memory_says_where_each_part_lies(one_shard):
    store, stub, client = one_shard
    link = client.shm_links[0]
    assert link is not None
    answers = list(stub.Pull(ps_pb2.PullRequest(worker_id=0, shm=link.pull.name), timeout=10))
    assert [(a.chunk.name, a.chunk.shm_offset, a.chunk.shm_bytes, a.chunk.data) for a in answers] == [
        ("w", 0, 80, b"")]
    got = torch.frombuffer(bytearray(link.read(link.pull.name, 0, 80)), dtype=torch.float32)
    assert torch.equal(got, store.reader.weights("w")[0].reshape(-1))


def test_no_room_in_dev_shm_falls_back_to_the_calls(cluster2, monkeypatch, caplog):
    """A /dev/shm too small for the segments (a container's 64 MB) is an OSError when they are made, not a
    SIGBUS later: the worker says so and trains with the bytes in its calls' frames on the data connection."""
    import errno

    from shardps.worker.datapath import shm as worker_shm

    def full(tag, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(worker_shm.shm, "create", full)
    model = path_model()
    with shardps.connect(cluster2.addresses, part_bytes=1024) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1))
        assert client.shm_links == [None, None]
        assert [type(p).__name__ for p in client.paths] == ["ConnPath"] * 2
        model(torch.randn(4, 10)).sum().backward()
        opt.step()
    assert "no shared memory here" in caplog.text and "tensor bytes go in the data connection" in caplog.text


def test_segments_of_a_dead_worker_are_removed_by_the_next(tmp_path):
    """A worker killed without removing its segments (here: os._exit, no atexit) leaves them unlocked; the next
    one to look removes them, and leaves a living worker's alone."""
    import subprocess
    import sys

    code = ("from shardps.protos import shm; import os; s = shm.create('dead', 4096); "
            "print(s.name, flush=True); os._exit(0)")
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()
    alive = shm.create("alive", 4096)
    try:
        assert (Path("/dev/shm") / dead).exists()
        gone = shm.remove_stale(min_age_s=0.0)
        assert dead in gone and alive.name not in gone
        assert not (Path("/dev/shm") / dead).exists() and (Path("/dev/shm") / alive.name).exists()
    finally:
        alive.close()


def _push_bucketed(client, grads, step):
    stream = client.push_bucketed(step)
    stream.add(grads)
    return stream.finish()


@pytest.mark.parametrize("push", ["push", "push_bucketed"])
def test_a_half_gradient_that_overflows_in_the_cast_skips_the_step_on_every_shard(cluster2, push):
    """Gradients are cast to their push dtype as they are copied into shared memory: the bytes checked for
    inf/nan are those the shards read (1e5 is finite in fp32, inf in float16)."""
    send = (lambda c, g, step: c.push(g, step=step)) if push == "push" else _push_bucketed
    w = torch.randn(600)
    with shardps.connect(cluster2.addresses, part_bytes=1024) as client:
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp", grad_dtype=torch.float16)
        assert all(client.shm_links) and {p.server for p in client.shard_map.parts_of("w")} == {0, 1}
        sources = []  # what is copied into the segments: the fp32 gradient itself, cast as it is copied
        for link in client.shm_links:
            real = link.write_push
            link.write_push = lambda *a, real=real: sources.append(a[2].dtype) or real(*a)
        last = next(p for p in client.shard_map.parts_of("w") if p.server == 1)
        grad = torch.full((600,), 0.5)
        grad[last.start] = 1e5  # on the second shard only
        send(client, {"w": grad}, 0)
        assert sources == [torch.float32] * len(client.shard_map.parts_of("w"))
        assert [st.applier.skipped_steps_total for st in cluster2.stores] == [1, 1]
        assert torch.equal(client.pull(min_versions=1)["w"], w)  # neither shard stepped
        grad[last.start] = 0.5
        send(client, {"w": grad}, 1)
        assert torch.equal(client.pull(min_versions=2)["w"], w - 0.5)
        assert [st.applier.skipped_steps_total for st in cluster2.stores] == [1, 1]


def test_a_shard_whose_shared_memory_goes_off_after_the_copy_gets_the_cast_gradient_in_its_frames(make_cluster,
                                                                                              monkeypatch):
    """A fail-over turns a shard's segments off: a gradient meant to be cast into them goes in the frames,
    cast the same way."""
    from shardps.worker.datapath.shm import ShmLink

    w = torch.randn(600)
    grad = torch.randn(600)
    results = []
    for off in (False, True):
        cluster = make_cluster(2)
        with shardps.connect(cluster.addresses, part_bytes=1024) as client:
            client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp", grad_dtype=torch.bfloat16)
            real = ShmLink.write

            def write_then_off(link, flats, parts=None, real=real, client=client, off=off):
                out = real(link, flats, parts)
                if off and link is client.shm_links[1]:
                    client.paths.off(1)  # as Transport.on_moved does once the shard moved
                return out

            monkeypatch.setattr(ShmLink, "write", write_then_off)
            client.push({"w": grad}, step=0)
            assert [link is not None for link in client.shm_links] == [True, not off]
            results.append(client.pull(min_versions=1)["w"])
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], w - grad.bfloat16().float())


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_streamed_push_cast_into_shared_memory_survives_a_fail_over(tmp_path):
    """Overlap's push stream casts a gradient into each shard's segment as it is handed in. The primary of
    shard 1 is killed after that, before the stream ends: the stream is retried on the backup, in the frames
    (segments are for the shard's first address), cast the same way, and applied once."""
    w, grad = torch.randn(600), torch.randn(600)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        with shardps.connect(c.addresses, part_bytes=1024) as client:
            client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp", grad_dtype=torch.bfloat16)
            assert all(client.shm_links) and {p.server for p in client.shard_map.parts_of("w")} == {0, 1}
            stream = client.push_bucketed(0)
            stream.add({"w": grad})  # written into both segments now
            c.kill(1)  # shard 1's primary: its stream has not ended, nothing of it was applied
            res = stream.finish()
            assert client.transport.failovers_total == 1 and [bool(link) for link in client.shm_links] == [True, False]
            assert [r.version for r in res] == [1, 1]
            got = client.pull(min_versions=1)["w"]
    assert torch.equal(got, w - grad.bfloat16().float())


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_push_that_holds_no_gradient_is_sent_again_from_the_segments_after_a_fail_over(tmp_path):
    """``hold_gradients=False`` (a streamed worker's push stream): a gradient is copied into its shards' segments
    as it is handed in and the stream keeps no reference to it, so the caller may free or reuse it at once.
    Here it is overwritten with nan. The primary of shard 1 is then killed before the stream ends: the stream
    is retried on the backup, in the frames, from the values the closed segment still maps, and applied once,
    with the gradient as it was handed in."""
    w, grad = torch.randn(600), torch.randn(600)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        with shardps.connect(c.addresses, part_bytes=1024) as client:
            client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp")
            assert all(client.shm_links) and {p.server for p in client.shard_map.parts_of("w")} == {0, 1}
            stream = client.push_bucketed(0, hold_gradients=False)
            mine = grad.clone()
            stream.add({"w": mine})  # written into both segments now
            mine.fill_(float("nan"))  # the caller's memory, reused: the stream reads none of it again
            c.kill(1)  # shard 1's primary: its stream has not ended, nothing of it was applied
            res = stream.finish()
            assert client.transport.failovers_total == 1 and [bool(link) for link in client.shm_links] == [True, False]
            assert [r.version for r in res] == [1, 1] and all(r.applied for r in res)
            got = client.pull(min_versions=1)["w"]
    assert torch.equal(got, w - grad)


def test_an_empty_tensor_beside_a_cast_one(cluster2):
    with shardps.connect(cluster2.addresses, part_bytes=1024) as client:
        client.register({"w": torch.zeros(600), "e": torch.zeros(0)}, shardps.optim.SGD(lr=1.0), sync="asp",
                        grad_dtype=torch.bfloat16)
        client.push({"w": torch.ones(600), "e": torch.zeros(0)}, step=0)
        got = client.pull(min_versions=1)
    assert torch.equal(got["w"], torch.full((600,), -1.0)) and got["e"].numel() == 0


def test_a_segment_closed_before_the_copy_sends_that_shards_share_in_its_messages_checked_as_cast(cluster2):
    """A fail-over in another thread may close a shard's segments between the push's look at its links
    and its copy: that shard's share goes in its messages, and what goes there is what is checked."""
    w = torch.randn(600)
    with shardps.connect(cluster2.addresses, part_bytes=1024) as client:
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp", grad_dtype=torch.float16)
        last = next(p for p in client.shard_map.parts_of("w") if p.server == 1)
        client.shm_links[1].push.close()  # closed, and still listed: as at the moment of the race
        grad = torch.full((600,), 0.5)
        grad[last.start] = 1e5  # inf in float16, on the closed shard's share only
        client.push({"w": grad}, step=0)
        assert [st.applier.skipped_steps_total for st in cluster2.stores] == [1, 1]
        grad[last.start] = 0.5
        client.push({"w": grad}, step=1)
        assert torch.equal(client.pull(min_versions=2)["w"], w - 0.5)
        stream = client.push_bucketed(2)  # a stream casts into the segments as gradients are handed in
        stream.add({"w": grad})  # shard 1's is closed: cast into a buffer instead, no error here
        assert "w" not in stream._written
        stream.abort()
