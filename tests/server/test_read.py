"""ShardStore.read: Pull responses framed once per version and shared while in flight, never stale."""

from __future__ import annotations

import threading

import pytest
import torch

import shardps
from shardps.protos import framing
from shardps.server.datapath.reader import Framing
from shardps.server.errors import Unavailable
from shardps.server.store import ShardStore, TensorSpec


def _store(sync: str = "asp") -> ShardStore:
    st = ShardStore(0, 1, sync=sync, num_workers=2)
    st.path.register_tensors([TensorSpec("w", (6,), 1, shardps.optim.SGD(lr=1.0), ((0, 6),))], {("w",
                                                                                                 0): torch.zeros(6)})
    st.leases.register(0)
    st.leases.register(1)
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
    _, first = st.reader.read(["w"], None, messages=True)  # held, as by a Pull still streaming it
    _, second = st.reader.read(["w"], None, messages=True)
    assert st.reader.cache.hits_total == 1 and first is second  # the same bytes, not a copy
    assert st.reader.pulls_total == 2 and st.reader.pull_bytes_total == 2 * 24
    del first, second  # both Pulls done: the framed bytes are freed, the next Pull frames again
    st.reader.read(["w"], None, messages=True)
    assert st.reader.cache.hits_total == 1
    held = st.reader.read(["w"], None, messages=True)
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)})
    _, third = st.reader.read(["w"], None, messages=True)
    assert st.reader.cache.hits_total == 1 and held[1] is not third  # framed again: the weights moved
    v, values = _values(third)
    assert v == 1 and torch.equal(values, torch.full((6,), -1.0))
    # Another dtype, chunk size or clock is another framing; the sync mode is in every header.
    held = [st.reader.read(["w"], framing.ps_pb2.BFLOAT16, messages=True), st.reader.read(["w"], None, 8,
                                                                                          messages=True),
            st.reader.read(["w"], None, messages=True, slowest_clock=3)]
    assert st.reader.cache.hits_total == 1 and len(held) == 3
    st.path.set_sync("bsp")
    _, fourth = st.reader.read(["w"], None, messages=True)
    assert st.reader.cache.hits_total == 1 and framing.parse_pull_response(fourth[0][3]).sync == "bsp"
    assert third is not fourth


def test_a_restore_invalidates_the_framed_pulls():
    st = _store()
    version, meta, tensors = st.snapshot()
    held = [st.reader.read(["w"], None, messages=True)]
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)})
    held.append(st.reader.read(["w"], None, messages=True))  # version 1 framed, still streaming
    st.restore(version, meta, tensors)  # back to version 0: a different state at an earlier version
    v, values = _values(st.reader.read(["w"], None, messages=True)[1])
    assert v == 0 and torch.equal(values, torch.zeros(6))


# -- large Pulls: framed outside the store's lock by a thread of their own -------------------------------

def _big_store(monkeypatch, block_after: int | None = None, fail_after: int | None = None):
    """A store whose Pulls of "w" (4096 fp32) go through a ``Framing`` in 1 KiB chunks; the framing thread
    stops after ``block_after`` items until ``release`` is set, or raises after ``fail_after`` items."""
    from shardps.server.datapath import reader as pullcache

    st = ShardStore(0, 1, sync="asp", num_workers=2)
    st.path.register_tensors([TensorSpec("w", (4096,), 1, shardps.optim.SGD(lr=1.0), ((0, 4096),))],
                        {("w", 0): torch.zeros(4096)})
    st.leases.register(0)
    st.leases.register(1)
    st.reader.frame_inline_bytes = 0
    framed, release = threading.Event(), threading.Event()
    real = pullcache.frame_items

    def items(*args, **kw):
        for i, item in enumerate(real(*args, **kw)):
            if i == fail_after:
                raise RuntimeError("injected framing fault")
            if i == block_after:
                framed.set()
                assert release.wait(30), "the test never released the framing"
            yield item

    monkeypatch.setattr(pullcache, "frame_items", items)
    return st, framed, release


def _all_values(messages, n: int = 4096) -> tuple[set[int], torch.Tensor]:
    out = torch.full((n,), float("nan"))
    versions = set()
    for msg in messages:
        r = framing.parse_pull_response(msg)
        vals = torch.frombuffer(bytearray(r.chunk.data), dtype=torch.float32)
        out[r.chunk.offset:r.chunk.offset + vals.numel()] = vals
        versions.add(r.version)
    return versions, out


@pytest.mark.fault
def test_a_large_pull_is_framed_outside_the_lock_and_a_step_waits_for_it(monkeypatch):
    st, framed, release = _big_store(monkeypatch, block_after=1)
    version, framing_ = st.reader.read(["w"], None, 1024, messages=True)
    assert isinstance(framing_, Framing) and version == 0
    assert framed.wait(30)  # the framing thread stopped after its first response, the weights half read
    # The store's lock is free meanwhile: other requests are answered, a Pull of the same asks shares it.
    assert st.stats().version == 0
    again = st.reader.read(["w"], None, 1024, messages=True)[1]
    assert again is framing_ and st.reader.cache.hits_total == 1
    # A step must not change the weights under the framing: it waits for it (at an exact point, not a moment).
    stepper = threading.Thread(target=st.path.submit, args=(0, 0, 0, {("w", 0): torch.ones(4096)}))
    stepper.start()
    with st._cond:
        assert st._cond.wait_for(lambda: st.reader.writers_waiting == 1, timeout=30)
        assert st.job.version == 0 and st.reader.reading == 1
    release.set()
    versions, values = _all_values(msg for *_, msg in framing_)
    stepper.join(30)
    assert not stepper.is_alive() and st.job.version == 1
    assert versions == {0} and torch.equal(values, torch.zeros(4096))  # all of version 0, none torn
    # The next Pull frames version 1 anew.
    versions, values = _all_values(msg for *_, msg in st.reader.read(["w"], None, 1024, messages=True)[1])
    assert versions == {1} and torch.equal(values, torch.full((4096,), -1.0))
    assert st.reader.reading == 0


@pytest.mark.fault
def test_a_failed_framing_fails_its_pulls_and_lets_steps_go_on(monkeypatch):
    st, _, _ = _big_store(monkeypatch, fail_after=2)
    _, failed = st.reader.read(["w"], None, 1024, messages=True)
    with pytest.raises(Unavailable, match="framing the weights failed.*injected framing fault"):
        list(failed)
    with st._cond:  # the framing thread let go of the weights
        assert st._cond.wait_for(lambda: st.reader.reading == 0, timeout=30)
    monkeypatch.undo()  # framing works again: the failed one, still held, is not handed to the next Pull
    _, fresh = st.reader.read(["w"], None, 1024, messages=True)
    assert fresh is not failed and st.reader.cache.hits_total == 0
    versions, values = _all_values(msg for *_, msg in fresh)
    assert versions == {0} and torch.equal(values, torch.zeros(4096))
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(4096)})
    versions, values = _all_values(msg for *_, msg in st.reader.read(["w"], None, 1024, messages=True)[1])
    assert versions == {1} and torch.equal(values, torch.full((4096,), -1.0))


def test_a_small_pull_is_still_framed_under_the_lock_as_a_list():
    st = _store()
    assert st.reader.frame_inline_bytes >= 1 << 20
    _, messages = st.reader.read(["w"], None, messages=True)
    assert isinstance(messages, list) and st.reader.reading == 0


class _SlowSegment:
    """A same-host segment over a bytearray whose copy stops before its second part until released."""

    def __init__(self, size: int) -> None:
        self.name, self.size = "test-segment", size
        self.buf = bytearray(size)
        self.copying, self.release = threading.Event(), threading.Event()
        self.views = 0

    def view(self, offset: int, nbytes: int) -> memoryview:
        self.views += 1
        if self.views == 2:
            self.copying.set()
            assert self.release.wait(30), "the test never released the copy"
        return memoryview(self.buf)[offset:offset + nbytes]


@pytest.mark.fault
def test_a_same_host_pull_copies_outside_the_lock_and_a_step_waits_for_it():
    st = ShardStore(0, 1, sync="asp", num_workers=1)
    sgd = shardps.optim.SGD(lr=1.0)
    st.path.register_tensors([TensorSpec("a", (64,), 1, sgd, ((0, 64),)), TensorSpec("b", (64,), 1, sgd, ((0, 64),))],
                        {("a", 0): torch.zeros(64), ("b", 0): torch.zeros(64)})
    st.leases.register(0)
    seg = _SlowSegment(1024)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(st.reader.read_into(["a", "b"], None, seg)))
    reader.start()
    assert seg.copying.wait(30)  # "a" copied, "b" not yet: the store's lock is free meanwhile
    assert st.stats().version == 0
    stepper = threading.Thread(target=st.path.submit, args=(0, 0, 0, {("a", 0): torch.ones(64), ("b",
                                                                                                 0): torch.ones(64)}))
    stepper.start()
    with st._cond:
        assert st._cond.wait_for(lambda: st.reader.writers_waiting == 1, timeout=30)
        assert st.job.version == 0
    seg.release.set()
    reader.join(30)
    stepper.join(30)
    assert not reader.is_alive() and not stepper.is_alive() and st.job.version == 1
    version, items = got[0]
    assert version == 0 and {framing.parse_pull_response(msg).version for *_, msg in items} == {0}
    for *_, msg in items:  # both parts hold version 0's weights, none torn
        c = framing.parse_pull_response(msg).chunk
        assert torch.equal(torch.frombuffer(seg.buf, dtype=torch.uint8)[c.shm_offset:c.shm_offset + c.shm_bytes]
                           .view(torch.float32), torch.zeros(64))
    assert st.reader.reading == 0


def test_a_framing_thread_that_cannot_start_fails_its_pull_and_the_next_one_frames_again(monkeypatch):
    from shardps.server.datapath import reader as pullcache

    st, _, _ = _big_store(monkeypatch)

    class NoThread:
        def __init__(self, *args, **kw):
            pass

        def start(self):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pullcache.threading, "Thread", NoThread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        st.reader.read(["w"], None, 1024, messages=True)
    assert st.reader.reading == 0
    monkeypatch.undo()
    versions, values = _all_values(msg for *_, msg in st.reader.read(["w"], None, 1024, messages=True)[1])
    assert versions == {0} and torch.equal(values, torch.zeros(4096))


def test_a_shared_answers_buffer_is_reused_only_once_nothing_holds_it():
    """Reader.read_shared: each version's weights get a buffer of their own, which an answer may still be sending
    while the next version is stepped; once no answer and no cache entry holds it, the next version's copy goes
    there (no fresh pages each version), never while a view of it lives."""
    st = _store()
    _, items, first = st.reader.read_shared(["w"], None, 1024)
    held = first[0:24]  # an answer still being sent: a slice of the payload, as the Sender keeps it
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)})  # version 1 (asp): the version's entry is cleared
    assert not st.reader.shared
    _, _, second = st.reader.read_shared(["w"], None, 1024)
    addr = lambda v: torch.frombuffer(v, dtype=torch.uint8).data_ptr()  # noqa: E731
    assert addr(second) != addr(held)  # version 0's bytes are still being sent: not written over
    assert torch.equal(torch.frombuffer(bytearray(held), dtype=torch.float32), torch.zeros(6))
    spares = {addr(held), addr(second)}
    del first, held, items  # version 0's answer is sent: its buffer is a spare now
    st.path.submit(0, 1, 1, {("w", 0): torch.ones(6)})  # version 2
    del second  # version 1's too, its entry cleared by the step
    assert len(st.reader._spare) == 2
    _, _, third = st.reader.read_shared(["w"], None, 1024)
    assert addr(third) in spares and len(st.reader._spare) == 1  # a spare, not new pages
    v = torch.frombuffer(bytearray(third[:24]), dtype=torch.float32)
    assert torch.equal(v, torch.full((6,), -2.0))  # version 2's weights, written into the spare


class _Queued:
    """What a ``Sender`` does with a lent answer it could not write whole: keeps it, and copies its rest when
    detached (the bytes it would still have sent: here, all of them)."""

    def __init__(self, lent) -> None:
        self.lent, self.copied = lent, None
        lent.queued(self.detach)

    def detach(self) -> None:
        self.copied = b"".join(bytes(v) for v in self.lent.views)
        self.lent.sent()


def test_an_answer_lent_from_the_weights_is_copied_before_a_step_changes_them():
    """Reader.read_lent: fp32 weights go as themselves (no copy, one framing a version); an answer still
    queued when a step comes is detached first, so it carries the version it was read at."""
    st = _store()
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)})  # version 1: weights -1
    version, items, lent = st.reader.read_lent(["w"], None, 1024)
    _, again, other = st.reader.read_lent(["w"], None, 1024)  # a second worker's: the same framing
    assert version == 1 and again is items and other.views is lent.views and st.reader.reading == 2
    weight = st.table["w"].parts[0].weight
    assert lent.views[0].obj is not None and torch.frombuffer(lent.views[0], dtype=torch.float32).data_ptr() \
        == weight.data_ptr()  # the weights themselves
    queued = _Queued(lent)  # the socket took none of it
    other.sent()  # the other answer went whole
    lent.close()
    other.close()
    assert st.reader.reading == 0 and st.reader.shared_copies_total == 0 and len(st.reader._sending) == 1
    st.path.submit(1, 0, 0, {("w", 0): torch.ones(6)})  # version 2: detaches the queued answer first
    assert torch.equal(torch.frombuffer(bytearray(queued.copied), dtype=torch.float32), torch.full((6,), -1.0))
    assert not st.reader._sending and not st.reader.lent
    assert torch.equal(st.reader.weights("w")[0], torch.full((6,), -2.0))


def test_an_answer_in_another_dtype_than_the_weights_is_a_shared_copy():
    st = _store()
    _, _, payload = st.reader.read_lent(["w"], shardps.protos.shardps.v1.ps_pb2.BFLOAT16, 1024)
    assert isinstance(payload, memoryview) and st.reader.shared_copies_total == 1 and st.reader.reading == 0
    _, _, lent = st.reader.read_lent(["w"], None, 1024)
    assert not isinstance(lent, memoryview)
    lent.close()
    counted = st.reader.pulls_total, st.reader.pull_bytes_total
    for dtype in (None, shardps.protos.shardps.v1.ps_pb2.BFLOAT16):  # framed already, or copied already
        with pytest.raises(shardps.server.errors.InvalidArgument, match="pull buffer holds 8 bytes"):
            st.reader.read_lent(["w"], dtype, 8)
    assert st.reader.reading == 0 and (st.reader.pulls_total, st.reader.pull_bytes_total) == counted  # refused
