"""The worker's data path as values: the push builder and the job view. (Its imports: tests/test_layering.py.)"""

from __future__ import annotations

import torch

from shardps.protos import codec, framing
from shardps.protos.results import PushResult
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.accumulate import Accumulator
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.job.jobview import JobView

HEAD: dict = dict(worker_id=1, step=7, base_version=5, loss_scale=8.0, epoch=2, sync=("every:2", 3))
WIRE = {**{k: v for k, v in HEAD.items() if k != "sync"}, "sync": "every:2", "sync_switch": 3}  # as PushRequest's


def _parse(messages: list[bytes]) -> list[ps_pb2.PushRequest]:
    return [ps_pb2.PushRequest.FromString(m) for m in messages]


def test_a_plain_push_marks_its_last_chunk_message_last_and_every_message_carries_the_header():
    flat = torch.arange(10, dtype=torch.float32)
    f = PushFramer(found_inf=True, fields={"pull_after": True, "pull_min_clock": 3}, **HEAD)
    msgs = _parse(list(f.ending(f.chunks("w", ps_pb2.FLOAT32, (10,), flat, 0, 10, chunk_bytes=16))))
    assert [m.chunk.offset for m in msgs] == [0, 4, 8]
    assert [m.last for m in msgs] == [False, False, True]
    for m in msgs:
        assert (m.worker_id, m.step, m.base_version, m.loss_scale, m.epoch) == (1, 7, 5, 8.0, 2)
        assert (m.sync, m.sync_switch) == ("every:2", 3)
        assert m.found_inf and m.ends_with_last and m.pull_after and m.pull_min_clock == 3 and not m.shm
    got = torch.cat([codec.decode(m.chunk.data, m.chunk.dtype) for m in msgs])
    assert torch.equal(got, flat) and list(msgs[0].chunk.shape) == [10]


def test_a_push_of_one_chunk_is_one_message_and_one_of_none_a_chunk_less_last_message():
    f = PushFramer(**HEAD)
    one = list(f.ending(f.chunks("w", ps_pb2.FLOAT32, (2,), torch.ones(2), 0, 2, chunk_bytes=1 << 20)))
    assert len(one) == 1 and _parse(one)[0].last and _parse(one)[0].chunk.name == "w"
    none = _parse(list(PushFramer(**HEAD).ending(iter(()))))
    assert len(none) == 1 and none[0].last and not none[0].HasField("chunk")


def test_the_builder_frames_as_protobuf_does():
    # The bytes are protobuf's own serialization: the shards parse them with the generated code.
    f = PushFramer(found_inf=False, **HEAD)
    (msg,) = f.ending(f.chunks("b", ps_pb2.FLOAT32, (3,), torch.ones(3), 0, 3, chunk_bytes=1 << 20))
    want = ps_pb2.PushRequest(chunk=ps_pb2.Chunk(name="b", offset=0, dtype=ps_pb2.FLOAT32, shape=[3],
                                                 data=torch.ones(3).numpy().tobytes()),
                              ends_with_last=True, last=True, **WIRE)
    assert msg == want.SerializeToString()
    prefix, suffix = framing.header(ps_pb2.PushRequest, found_inf=True, last=True, ends_with_last=True, **WIRE)
    assert PushFramer(**HEAD).end(found_inf=True) == prefix + suffix


def test_a_streamed_push_raises_found_inf_only_on_its_last_message_through_shared_memory_too():
    chunks = [ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT16, shm_offset=0, shm_bytes=8)]
    f = PushFramer(shm="shardps-w1-s0-push", **HEAD)
    msgs = _parse([*f.shm_chunks(chunks, last=False), f.end(found_inf=True)])
    assert [(m.found_inf, m.last, m.shm) for m in msgs] == [(False, False, "shardps-w1-s0-push"),
                                                            (True, True, "shardps-w1-s0-push")]
    plain = _parse(list(PushFramer(found_inf=True, shm="seg", **HEAD).shm_chunks(chunks, last=True)))
    assert [(m.found_inf, m.last, m.chunk.shm_bytes) for m in plain] == [(True, True, 8)]
    empty = _parse(list(PushFramer(shm="seg", **HEAD).shm_chunks([], last=True)))
    assert len(empty) == 1 and empty[0].last and not empty[0].HasField("chunk")
    assert list(PushFramer(shm="seg", **HEAD).shm_chunks([], last=False)) == []


def test_a_push_view_says_the_first_shards_scale_the_newest_switchs_sync_and_nothing_of_clocks_or_versions():
    results = [PushResult(version=3, applied=True, duplicate=False, sync="asp", loss_scale=2.0, ready_version=3),
               PushResult(version=4, applied=True, duplicate=False, sync="asp", loss_scale=2.0, ready_version=4)]
    assert JobView.of_push(results) == JobView(sync="asp", sync_switch=0, loss_scale=2.0)
    assert JobView.of_push([]) == JobView()
    # Mid-switch: shard 1 has had switch 3 (bsp), shard 0 not yet. The view says the newest.
    results[1] = PushResult(version=4, applied=False, duplicate=False, sync="bsp", loss_scale=2.0, ready_version=5,
                            sync_switch=3)
    assert JobView.of_push(results) == JobView(sync="bsp", sync_switch=3, loss_scale=2.0)


class _Client:
    def __init__(self) -> None:
        self.sync, self.loss_scale, self.slowest_clock, self.versions = "bsp", 4.0, 1, [0, 0]
        self.sync_switch = 1


def test_the_client_takes_a_view_in_one_place_keeping_what_it_does_not_say():
    from shardps.worker.client import PSClient

    c = _Client()
    PSClient.apply(c, JobView(versions=((1, 9),)))  # type: ignore[arg-type]
    assert (c.sync, c.loss_scale, c.slowest_clock, c.versions) == ("bsp", 4.0, 1, [0, 9])
    PSClient.apply(c, JobView(sync="asp", sync_switch=2, loss_scale=0.0, slowest_clock=3))  # type: ignore[arg-type]
    assert (c.sync, c.sync_switch, c.loss_scale, c.slowest_clock, c.versions) == ("asp", 2, 0.0, 3, [0, 9])
    # An older switch's mode (a shard not switched yet), or a mode with no switch (a Pull's): kept as it was.
    PSClient.apply(c, JobView(sync="bsp", sync_switch=1))  # type: ignore[arg-type]
    PSClient.apply(c, JobView(sync="bsp"))  # type: ignore[arg-type]
    assert (c.sync, c.sync_switch) == ("asp", 2)


def test_the_accumulator_pushes_the_mean_and_forgets():
    acc = Accumulator()
    acc.add({"w": torch.ones(2)})
    assert torch.equal(acc.mean_with("w", torch.full((2,), 3.0), 2), torch.full((2,), 2.0))
    acc.add({"w": torch.full((2,), 3.0)})
    assert acc.steps == 2 and torch.equal(acc.mean()["w"], torch.full((2,), 2.0))
    assert acc.steps == 0 and acc.sum_of("w") is None
