"""The shard paths (worker/datapath/paths.py): which path each shard gets, and the fall-back to gRPC when a segment
closes.

No server: real segments in /dev/shm, the messages compared byte for byte with gRPC's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shardps.protos import codec, shm
from shardps.protos.optim import SGD
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath import shm as worker_shm
from shardps.worker.datapath.paths import GrpcPath, ShmPath
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.shardpaths import ShardPaths
from shardps.worker.layout import Layout, plan

pytestmark = pytest.mark.skipif(
    not shm.available(),
    reason="no writable /dev/shm on this machine: the same-host path is off, every shard is reached over gRPC")


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
    paths = ShardPaths(7, 2)
    paths.open(route.shard_map, route.layouts, [True, True])
    yield paths
    paths.close()


def frames(segment: str) -> PushFramer:
    return PushFramer(worker_id=7, step=3, base_version=2, loss_scale=0.0, epoch=1, sync=("bsp", 0), shm=segment)


def test_a_shard_gets_shared_memory_when_it_read_the_probe_and_grpc_otherwise(route):
    paths = ShardPaths(7, 2)
    assert [type(p) for p in paths] == [GrpcPath, GrpcPath]
    paths.open(route.shard_map, route.layouts, [True, False])
    try:
        shared, remote = paths
        assert isinstance(shared, ShmPath) and isinstance(remote, GrpcPath)
        assert shared.writes_ahead and not remote.writes_ahead
        assert shared.push_segment == shared.link.push.name and shared.pull_segment == shared.link.pull.name
        assert remote.push_segment == remote.pull_segment == ""
        assert paths.links == [shared.link, None]
        names = [shared.push_segment, shared.pull_segment]
        assert all((Path("/dev/shm") / n).exists() for n in names)
    finally:
        paths.close()
    assert [type(p) for p in paths] == [GrpcPath, GrpcPath]
    assert not any((Path("/dev/shm") / n).exists() for n in names)


def test_a_shard_whose_segments_cannot_be_made_gets_grpc(route, monkeypatch):
    def full(tag, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(worker_shm.shm, "create", full)
    paths = ShardPaths(7, 2)
    paths.open(route.shard_map, route.layouts, [True, True])
    assert [type(p) for p in paths] == [GrpcPath, GrpcPath]


def test_a_fail_over_turns_the_shard_to_grpc_and_closes_its_segments(paths, route):
    old = paths[1]
    assert isinstance(old, ShmPath)
    paths.off(1)  # Transport.on_moved
    assert isinstance(paths[0], ShmPath) and paths[1] is old.grpc and paths.links[1] is None
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


def test_a_segment_closed_before_the_copy_sends_the_share_over_grpc_cast_and_checked_as_grpc_would(paths, route):
    """The same bytes as a shard that was on gRPC all along, given the gradient already cast."""
    grad = torch.randn(600)
    grad[next(p.start for p in route.shard_map.parts_for(1) if p.name == "w")] = torch.finfo(torch.float32).max
    assert not grad.bfloat16().isfinite().all()  # finite in fp32, inf in bf16: the check must see the cast
    path = paths[1]
    assert isinstance(path, ShmPath)
    path.link.push.close()  # a fail-over in another thread, between the push's look at the path and its copy
    staged = path.stage({"w": grad})
    assert staged is None
    got = list(path.push_messages(frames, staged, {"w": grad}, {"w"}, route))
    want = list(GrpcPath(1).push_messages(frames, None, {"w": grad.bfloat16()}, set(), route))
    assert got == want and len(want) > 1
    assert not any(ps_pb2.PushRequest.FromString(m).shm for m in got)
    checked = path.read_values(staged, {"w": grad}, {"w"}, route)
    assert [v.dtype for v in checked] == [torch.bfloat16] * len(checked)
    assert not all(codec.all_finite(v) for v in checked)


def test_a_streamed_bucket_goes_as_its_path_has_it(paths, route):
    grad = torch.randn(600).bfloat16()  # already in its push dtype
    ranges = {"w": [(p.start, p.stop) for p in route.shard_map.parts_for(0) if p.name == "w"]}
    f = frames(paths[0].push_segment)
    shared = [ps_pb2.PushRequest.FromString(m) for m in paths[0].bucket_messages(f, [("w", grad)], {}, ranges, route)]
    assert shared and all(m.shm == paths[0].push_segment and m.chunk.shm_bytes and not m.last for m in shared)
    g = frames("")
    over_grpc = list(paths[0].grpc.bucket_messages(g, [("w", grad)], {}, ranges, route))
    want = [m for a, b in ranges["w"] for m in g.chunks("w", ps_pb2.BFLOAT16, (600,), grad, a, b, route.chunk_bytes)]
    assert over_grpc == want


def test_a_pull_is_read_from_the_segment_or_the_message(paths):
    path = paths[0]
    assert isinstance(path, ShmPath)
    values = torch.arange(8, dtype=torch.float32)
    path.link.pull.view(0, 32)[:] = values.numpy().tobytes()
    c = ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32, shm_offset=0, shm_bytes=32)
    assert torch.equal(path.read(c), values)
    inline = ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32, data=values.numpy().tobytes())
    assert torch.equal(path.read(inline), values) and torch.equal(path.grpc.read(inline), values)
    with pytest.raises(ValueError, match="shard 0 answered with shared memory this client did not offer"):
        path.grpc.read(c)
    assert path.pull_messages(600, 4, 256) == 1  # one per part
    assert path.grpc.pull_messages(600, 4, 256) == 10 and path.grpc.pull_messages(600, 4, 2) == 600
