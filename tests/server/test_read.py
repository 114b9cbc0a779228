"""ShardStore.read: Pull responses framed once per version and shared while in flight, never stale."""

from __future__ import annotations

import torch

import shardps
from shardps.protos import framing
from shardps.server.store import ShardStore, TensorSpec


def _store(sync: str = "asp") -> ShardStore:
    st = ShardStore(0, 1, sync=sync, num_workers=2)
    st.register_tensors([TensorSpec("w", (6,), 1, shardps.optim.SGD(lr=1.0), ((0, 6),))], {("w", 0): torch.zeros(6)})
    st.register_worker(0)
    st.register_worker(1)
    return st


def _values(messages) -> tuple[int, torch.Tensor]:
    out = torch.empty(6)
    version = -1
    for _, _, _, msg in messages:
        r = framing.parse_pull_response(msg)
        vals = torch.frombuffer(bytearray(r.chunk.data), dtype=torch.float32)
        out[r.chunk.offset:r.chunk.offset + vals.numel()] = vals
        version = r.version
    return version, out


def test_pulls_of_one_version_share_one_framing_and_a_step_invalidates_it():
    st = _store()
    _, first = st.read(["w"], None, messages=True)  # held, as by a Pull still streaming it
    _, second = st.read(["w"], None, messages=True)
    assert st.framed_hits_total == 1 and first is second  # the same bytes, not a copy
    assert st.pulls_total == 2 and st.pull_bytes_total == 2 * 24
    del first, second  # both Pulls done: the framed bytes are freed, the next Pull frames again
    st.read(["w"], None, messages=True)
    assert st.framed_hits_total == 1
    held = st.read(["w"], None, messages=True)
    st.submit(0, 0, 0, {("w", 0): torch.ones(6)})
    _, third = st.read(["w"], None, messages=True)
    assert st.framed_hits_total == 1 and held[1] is not third  # framed again: the weights moved
    v, values = _values(third)
    assert v == 1 and torch.equal(values, torch.full((6,), -1.0))
    # Another dtype, chunk size or clock is another framing; the sync mode is in every header.
    held = [st.read(["w"], framing.ps_pb2.BFLOAT16, messages=True), st.read(["w"], None, 8, messages=True),
            st.read(["w"], None, messages=True, slowest_clock=3)]
    assert st.framed_hits_total == 1 and len(held) == 3
    st.set_sync("bsp")
    _, fourth = st.read(["w"], None, messages=True)
    assert st.framed_hits_total == 1 and framing.parse_pull_response(fourth[0][3]).sync == "bsp"
    assert third is not fourth


def test_a_restore_invalidates_the_framed_pulls():
    st = _store()
    version, meta, tensors = st.snapshot()
    held = [st.read(["w"], None, messages=True)]
    st.submit(0, 0, 0, {("w", 0): torch.ones(6)})
    held.append(st.read(["w"], None, messages=True))  # version 1 framed, still streaming
    st.restore(version, meta, tensors)  # back to version 0: a different state at an earlier version
    v, values = _values(st.read(["w"], None, messages=True)[1])
    assert v == 0 and torch.equal(values, torch.zeros(6))
