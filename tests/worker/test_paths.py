"""A shard's bytes in shared memory (worker/datapath/paths.py ``ShmPath``): written ahead, named by the messages,
and in the messages themselves when its segments closed (a fail-over).

No server: real segments in /dev/shm, the messages compared byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from shardps.protos import codec, shm
from shardps.protos.optim import SGD
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.worker.datapath import shm as worker_shm
from shardps.worker.datapath.paths import ShmPath, SliceRun, inline_messages
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.shm import ShmLink
from shardps.worker.layout import Layout, plan

pytestmark = pytest.mark.skipif(
    not shm.available(),
    reason="no writable /dev/shm on this machine: the same-host path is off")


@dataclass
class Plan:
    """A ``Routing``: what a path reads of its client."""

    shard_map: ShardMap
    layouts: dict[str, Layout]
    chunk_bytes: int = 256


@pytest.fixture
def route() -> Plan:
    layouts, smap = plan({"w": torch.zeros(600), "b": torch.zeros(10)}, SGD(lr=0.1), 2,
                         grad_dtype=torch.bfloat16, part_bytes=1024)
    assert {p.server for p in smap.parts_of("w")} == {0, 1}
    return Plan(smap, layouts)


@pytest.fixture
def paths(route: Plan):
    links = [ShmLink.open(7, i, route.shard_map, route.layouts) for i in range(2)]
    assert all(links)
    yield [ShmPath(link, i) for i, link in enumerate(links)]
    for link in links:
        link.close()


def frames(segment: str) -> PushFramer:
    return PushFramer(worker_id=7, step=3, base_version=2, loss_scale=0.0, epoch=1, sync=("bsp", 0), shm=segment)


def test_a_shards_segments_are_made_and_removed(route):
    link = ShmLink.open(7, 0, route.shard_map, route.layouts)
    assert link is not None
    path = ShmPath(link, 0)
    assert path.writes_ahead
    assert path.push_segment == link.push.name and path.take_pull(link.pull.size) == link.pull.name
    second = path.take_pull(100)  # the first is a Pull's until it is read: another Pull gets one of its own
    assert second != link.pull.name and path.take_pull(100) not in (link.pull.name, second)
    names = [path.push_segment, link.pull.name, second]
    assert all((Path("/dev/shm") / n).exists() for n in names)
    path.close()
    assert not any((Path("/dev/shm") / n).exists() for n in names)


def test_each_pull_in_flight_has_a_segment_of_its_own_sized_by_it_and_a_given_up_one_is_never_reused(route):
    """A Pull's segment is free again once its answer is read (``pulled``); a Pull takes the smallest free one
    that holds it, else a new one of its size (not the model's share); one given up (``unpulled``: the shard may
    still write its answer there) is removed, and the next Pull gets another."""
    link = ShmLink.open(7, 0, route.shard_map, route.layouts)
    assert link is not None
    path = ShmPath(link, 0)
    sizes = {}
    try:
        a, b = path.take_pull(link.pull.size), path.take_pull(1000)
        sizes = {s.name: s.size for s in link.pull_segments}
        assert a == link.pull.name and a != b and set(sizes) == {a, b} and sizes[b] == shm.aligned(1000)
        path.pulled(a)
        path.pulled(b)
        assert path.take_pull(500) == b  # read: free, and the smallest that holds it
        assert path.take_pull(500) == a  # the next smallest
        path.unpulled(b)  # given up: never again
        assert not (Path("/dev/shm") / b).exists() and b not in {s.name for s in link.pull_segments}
        c = path.take_pull(2000)
        assert c not in (a, b) and {s.name: s.size for s in link.pull_segments}[c] == shm.aligned(2000)
        path.pulled(a)
        path.unpulled(a)  # given up after it was given back (a failure after the read): out of the pool too
        assert path.take_pull(10) not in (a, b, c)
        with pytest.raises(ValueError, match="no pull segment"):
            link.read(b, 0, 4)
    finally:
        path.close()
    with pytest.raises(grpc.RpcError) as closed:  # a fail-over closed the link: asked again, no segment made
        path.take_pull(10)
    assert closed.value.code() == grpc.StatusCode.UNAVAILABLE and link.pull_segments == []


def test_segments_that_cannot_be_made_are_none(route, monkeypatch):
    def full(tag, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(worker_shm.shm, "create", full)
    assert ShmLink.open(7, 0, route.shard_map, route.layouts) is None


def test_closed_segments_take_nothing(paths, route):
    old = paths[1]
    old.link.close()  # ShardPaths.off, as Transport.on_moved calls it
    assert old.stage({"w": torch.ones(600)}) is None  # its segment is closed: nothing written


def test_a_staged_push_names_the_segment_and_carries_no_bytes(paths, route):
    grad = torch.randn(600)  # fp32, pushed as bf16: cast as it is copied into the segment
    path = paths[0]
    staged = path.stage({"w": grad})
    assert staged is not None
    mine = [p for p in route.shard_map.parts_for(0) if p.name == "w"]
    assert [(c.name, c.offset) for c, _ in staged] == [("w", p.start) for p in mine]
    for (_, values), p in zip(staged, mine):
        assert torch.equal(values, grad[p.start : p.stop].bfloat16())
    checked = path.read_values(staged, {"w": grad}, {"w"}, route)  # what was written, not cast again
    assert len(checked) == len(staged) and all(a is b for a, (_, b) in zip(checked, staged))
    msgs = [ps_pb2.PushRequest.FromString(m) for m in path.push_messages(frames, staged, {"w": grad}, {"w"}, route)]
    assert [(m.shm, m.last, m.chunk.data) for m in msgs] == [(path.push_segment, k == len(msgs) - 1, b"")
                                                            for k in range(len(msgs))]


def test_a_push_staged_on_another_path_is_written_into_the_segments_as_its_messages_are_made(paths, route):
    grad = torch.randn(600)
    path = paths[0]
    msgs = [ps_pb2.PushRequest.FromString(m) for m in path.push_messages(frames, None, {"w": grad}, {"w"}, route)]
    assert msgs and all(m.shm == path.push_segment and not m.chunk.data for m in msgs)
    for m in msgs:
        c = m.chunk
        got = codec.decode(path.link.push.view(c.shm_offset, c.shm_bytes), c.dtype)
        assert torch.equal(got, grad[c.offset : c.offset + got.numel()].bfloat16())


def test_a_segment_closed_before_the_copy_sends_the_share_in_the_messages_cast_and_checked(paths, route):
    """The bytes in the messages, as a shard without shared memory's would be, given the gradient already
    cast; the check sees the cast values."""
    grad = torch.randn(600)
    grad[next(p.start for p in route.shard_map.parts_for(1) if p.name == "w")] = torch.finfo(torch.float32).max
    assert not grad.bfloat16().isfinite().all()  # finite in fp32, inf in bf16: the check must see the cast
    path = paths[1]
    path.link.push.close()  # a fail-over in another thread, between the push's look at the path and its copy
    staged = path.stage({"w": grad})
    assert staged is None
    got = list(path.push_messages(frames, staged, {"w": grad}, {"w"}, route))
    f = frames("")
    want = list(f.ending(inline_messages(1, f, {"w": grad.bfloat16()}, set(), route)))
    assert got == want and len(want) > 1
    assert not any(ps_pb2.PushRequest.FromString(m).shm for m in got)
    checked = path.read_values(staged, {"w": grad}, {"w"}, route)
    assert [v.dtype for v in checked] == [torch.bfloat16] * len(checked)
    assert not all(codec.all_finite(v) for v in checked)


def test_a_streamed_bucket_names_the_segment(paths, route):
    grad = torch.randn(600).bfloat16()  # already in its push dtype
    ranges = {"w": [(p.start, p.stop) for p in route.shard_map.parts_for(0) if p.name == "w"]}
    f = frames(paths[0].push_segment)
    shared = [ps_pb2.PushRequest.FromString(m) for m in paths[0].bucket_messages(f, [("w", grad)], {}, ranges, route)]
    assert shared and all(m.shm == paths[0].push_segment and m.chunk.shm_bytes and not m.last for m in shared)


def test_a_pull_is_read_from_the_segment_or_the_message(paths):
    path = paths[0]
    values = torch.arange(8, dtype=torch.float32)
    path.link.pull.view(0, 32)[:] = values.numpy().tobytes()
    c = ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32, shm_offset=0, shm_bytes=32)
    assert torch.equal(path.read(c, path.link.pull.name), values)
    inline = ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32, data=values.numpy().tobytes())
    assert torch.equal(path.read(inline, ""), values)


def _slice_runs(route: Plan, shard: int, values: torch.Tensor) -> list[SliceRun]:
    """Shard ``shard``'s runs of the slice ``TensorSlice(0, 2, 1)`` of "w" (600 elements: the second half)."""
    sl = TensorSlice(0, 2, 1)
    lay = route.layouts["w"]
    return [SliceRun("w", p.start, at, n, values, lay.push_dtype, sl.shape(lay.shape))
            for p in route.shard_map.parts_for(shard) if p.name == "w"
            for at, n, _ in sl.pieces(lay.shape, p.start, p.stop)]


def test_a_sliced_push_writes_its_runs_into_their_parts_places_and_names_them(paths, route):
    values = torch.randn(300).bfloat16()  # the slice, in the push dtype
    runs = _slice_runs(route, 1, values)
    assert runs and sum(r.n for r in runs) <= 300
    path = paths[1]
    msgs = [ps_pb2.PushRequest.FromString(m) for m in path.slice_messages(frames, runs, 256)]
    assert [(m.shm, m.last, m.chunk.data) for m in msgs] == [(path.push_segment, k == len(msgs) - 1, b"")
                                                            for k in range(len(msgs))]
    stops = {p.start: p.stop for p in route.shard_map.parts_for(1) if p.name == "w"}
    for m, r in zip(msgs, runs, strict=True):
        c = m.chunk
        assert (c.name, c.offset, tuple(c.shape)) == ("w", r.at, (300,))  # the slice's offset and shape
        place = path.link.offsets[("w", r.part)]  # its part's place in the segment (bf16: 2 bytes an element)
        assert place <= c.shm_offset and c.shm_offset + c.shm_bytes <= place + 2 * (stops[r.part] - r.part)
        got = codec.decode(path.link.push.view(c.shm_offset, c.shm_bytes), c.dtype)
        assert torch.equal(got, values[r.at : r.at + r.n])


def test_a_sliced_push_whose_segment_closed_carries_its_runs_in_the_messages(paths, route):
    values = torch.randn(300).bfloat16()
    runs = _slice_runs(route, 1, values)
    path = paths[1]
    path.link.push.close()  # a fail-over in another thread
    got = list(path.slice_messages(frames, runs, 64))
    f = frames("")
    want = list(f.ending(m for r in runs for m in f.chunks("w", r.dtype, r.shape, values, r.at, r.at + r.n, 64)))
    assert got == want and len(want) > 1
    assert not any(ps_pb2.PushRequest.FromString(m).shm for m in got)
