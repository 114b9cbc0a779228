"""The data connection's sending side (protos/dataconn.py ``Sender``), its reads (``fill``) and the deadlines
thread (protos/deadlines.py): frames whole and in order whether the socket takes them at once or not, under
Python's deadline or the kernel's, a caller that never waits for the peer, a failure that ends the connection,
a whole part read in one call, deadlines that cost nothing when met."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from shardps.protos import dataconn as wire
from shardps.protos.deadlines import Deadlines


@pytest.fixture(params=["python", "kernel"])
def pair(request):
    """A connected pair with a 10 s deadline: Python's (``settimeout``: a non-blocking descriptor) or the
    kernel's (``deadlines_in_kernel``: a blocking one), as a data connection has after its hello."""
    a, b = socket.socketpair()
    for s in (a, b):
        if request.param == "kernel":
            wire.deadlines_in_kernel(s, 10.0)
        else:
            s.settimeout(10.0)
    yield a, b
    a.close()
    b.close()


class Counting(socket.socket):
    """A socket that counts its ``recv_into`` calls."""

    calls = 0

    def recv_into(self, *args, **kw):  # type: ignore[override]
        self.calls += 1
        return super().recv_into(*args, **kw)


def test_with_the_kernels_deadline_a_read_takes_a_whole_part_in_one_call_however_it_comes():
    a, b = socket.socketpair()
    reader = Counting(fileno=b.detach())
    wire.deadlines_in_kernel(reader, 10.0)
    view = memoryview(bytearray(300_000))
    done = threading.Event()
    t = threading.Thread(target=lambda: (wire.fill(reader, view), done.set()))
    t.start()
    for i in range(3):  # three writes, whenever the reader looks
        a.sendall(bytes([i + 1]) * 100_000)
    t.join(10)
    assert done.is_set() and reader.calls == 1
    assert bytes(view[::100_000]) == b"\x01\x02\x03"
    a.close()
    reader.close()


def test_the_kernels_deadline_ends_a_stalled_read_and_asks_an_idle_connection_first():
    a, b = socket.socketpair()
    wire.deadlines_in_kernel(b, 0.2)
    asked: list[int] = []
    with pytest.raises(wire.Torn) as idle:  # nothing came: asked twice, told to go on once
        wire.fill(b, memoryview(bytearray(10)), idle=lambda: asked.append(1) or len(asked) < 2)
    assert (idle.value.got, idle.value.why, len(asked)) == (0, "stalled past the deadline", 2)
    a.sendall(b"abc")
    with pytest.raises(wire.Torn) as part:  # some came, then nothing: not an idle connection
        wire.fill(b, memoryview(bytearray(10)), idle=lambda: True)
    assert (part.value.got, part.value.why) == (3, "stalled past the deadline")
    a.close()
    with pytest.raises(wire.Torn) as closed:
        wire.fill(b, memoryview(bytearray(10)))
    assert (closed.value.got, closed.value.why) == (0, "connection closed")
    b.close()


def _read(sock: socket.socket, n: int) -> bytes:
    return bytes(wire.read_exact(sock, n))


def test_a_frame_the_socket_takes_is_written_by_the_caller_without_a_thread(pair):
    a, b = pair
    s = wire.Sender(a, "t", lambda why: None)
    s.send([b"ab", memoryview(b"cd"), b""])
    assert _read(b, 4) == b"abcd"
    assert s.inline_frames == 1 and s.queued_frames == 0 and s._writer is None
    s.close()


def test_a_frame_of_any_buffers_goes_as_their_bytes(pair):
    """Parts of other formats (a float tensor's memoryview, a 2-D view) go as their bytes; a small head and
    control are one buffer (``head_and_control``), a large control keeps its pieces (no copy)."""
    import array

    a, b = pair
    s = wire.Sender(a, "t", lambda why: None)
    floats = array.array("f", [1.5, -2.0, 3.25])
    grid = memoryview(bytes(range(12))).cast("B", (3, 4))
    small = wire.head_and_control(b"HEAD", [b"c1", b"c2"], 4)
    assert small == [b"HEADc1c2"]
    big_ctl = bytes(wire.JOIN_CONTROL + 1)
    big = wire.head_and_control(b"HEAD", [big_ctl], len(big_ctl))
    assert big == [b"HEAD", big_ctl] and big[1] is big_ctl
    s.send([*small, memoryview(floats), grid])
    assert _read(b, 8 + 12 + 12) == b"HEADc1c2" + floats.tobytes() + bytes(range(12))
    s.send(big)
    assert _read(b, 4 + len(big_ctl)) == b"HEAD" + big_ctl
    s.close()


def test_frames_larger_than_the_socket_go_whole_and_in_order_while_the_caller_goes_on(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s = wire.Sender(a, "t", lambda why: None)
    frames = [bytes([i]) * (200_000 + i) for i in range(6)]
    for f in frames:  # nobody reads until all were sent: a send that waited for the reader would fail at 10 s
        s.send([f[:7], memoryview(f)[7:]])
    assert s.queued_frames >= 5 and s._writer is not None
    for f in frames:
        assert _read(b, len(f)) == f
    s.close()
    assert not s._writer.is_alive()


def test_concurrent_senders_never_interleave_their_frames(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    s = wire.Sender(a, "t", lambda why: None)
    n, size = 40, 30_000

    def send(k: int) -> None:
        for _ in range(n):
            s.send([bytes([k]) * 4, bytes([k]) * size])

    threads = [threading.Thread(target=send, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    got = {1: 0, 2: 0, 3: 0}
    for _ in range(3 * n):
        frame = _read(b, size + 4)
        assert len(set(frame)) == 1  # one sender's bytes only
        got[frame[0]] += 1
    for t in threads:
        t.join()
    assert got == {1: n, 2: n, 3: n}
    s.close()


def test_a_peer_gone_fails_the_next_send_and_tells_the_connection(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    told = []
    s = wire.Sender(a, "t", told.append)
    s.send([bytes(1_000_000)])  # queued: the writer thread waits on the socket
    b.close()
    s._writer.join(10)  # the write fails: the writer ends and says so
    assert told and "send failed" in told[0]
    with pytest.raises(OSError, match="send failed"):
        s.send([b"x"])
    s.close()


class Lending:
    """A ``protos.dataconn.Lender`` that records what the sender told it."""

    def __init__(self) -> None:
        self.detach = None
        self.sent_times = 0
        self.done = threading.Event()

    def queued(self, detach) -> None:
        self.detach = detach

    def sent(self) -> None:
        self.sent_times += 1
        self.done.set()


def test_a_lent_frame_the_socket_takes_is_done_with_before_send_returns(pair):
    a, b = pair
    s = wire.Sender(a, "t", lambda why: None)
    lent, data = Lending(), bytearray(b"x" * 100)
    s.send([b"HEAD", memoryview(data)], lent)
    assert lent.sent_times == 1 and lent.detach is None and s.inline_frames == 1
    data[:] = b"y" * 100  # the lender may change its memory now
    assert _read(b, 104) == b"HEAD" + b"x" * 100
    s.close()


def test_a_lent_frame_left_to_the_writer_is_copied_when_detached_and_arrives_as_lent(pair):
    """The rest of a lent frame the socket did not take is copied by ``detach`` (a step about to change the
    weights); the lender then changes its memory, and the peer still reads what was lent, in order."""
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s = wire.Sender(a, "t", lambda why: None)
    data = bytearray(os.urandom(2_000_000))
    original = bytes(data)
    lent = Lending()
    s.send([b"HEAD", memoryview(data)], lent)  # nobody reads yet: the rest waits for the writer
    assert lent.detach is not None and lent.sent_times == 0
    s.send([b"NEXT"])  # queued behind it
    lent.detach()
    assert lent.sent_times == 1 and s.detached_frames == 1
    data[:] = bytes(len(data))  # the lender changes its memory
    assert _read(b, 4 + len(original)) == b"HEAD" + original and _read(b, 4) == b"NEXT"
    lent.detach()  # again, or after the frame went: nothing
    assert lent.sent_times == 1 and s.detached_frames == 1
    s.close()


def test_a_lent_frame_the_writer_sends_whole_is_done_with_then_uncopied(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s = wire.Sender(a, "t", lambda why: None)
    data = os.urandom(1_000_000)
    lent = Lending()
    s.send([memoryview(data)], lent)
    assert lent.detach is not None and lent.sent_times == 0
    assert _read(b, len(data)) == data
    assert lent.done.wait(10) and lent.sent_times == 1 and s.detached_frames == 0
    s.close()


def test_a_lent_frame_dropped_with_its_connection_is_done_with(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    told: list[str] = []
    s = wire.Sender(a, "t", told.append)
    lent = Lending()
    s.send([memoryview(bytes(1_000_000))], lent)
    b.close()  # the peer goes: the writer fails, drops the frame and tells its lender
    assert lent.done.wait(10) and lent.sent_times == 1
    s._writer.join(10)
    assert told and "send failed" in told[0]
    closed = Lending()
    s.close()
    with pytest.raises(OSError):
        s.send([b"x"], closed)
    assert closed.sent_times == 0  # refused before anything was lent


def test_the_writer_ends_a_write_stalled_past_the_deadline():
    a, b = socket.socketpair()
    wire.deadlines_in_kernel(a, 0.5)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    told: list[str] = []
    s = wire.Sender(a, "t", told.append)
    lent = Lending()
    s.send([memoryview(bytes(1_000_000))], lent)  # the peer never reads
    s._writer.join(10)
    assert told == ["send failed: stalled past the deadline"] and lent.sent_times == 1
    s.close()
    a.close()
    b.close()


def test_a_writer_that_cannot_begin_fails_the_sender_and_tells_the_connection(pair, monkeypatch):
    """The writer thread's first look at its socket failing (a descriptor closed under it) ends the sender as a
    failed write would: the connection told, what was queued done with, the next send refused."""
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def gone(sock):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(wire, "_send_deadline", gone)
    told: list[str] = []
    s = wire.Sender(a, "t", told.append)
    lent = Lending()
    s.send([memoryview(bytes(1_000_000))], lent)  # left to the writer, which fails as it begins
    s._writer.join(10)
    assert not s._writer.is_alive() and lent.sent_times == 1
    assert told == ["send failed: [Errno 9] Bad file descriptor"]
    with pytest.raises(OSError, match="send failed"):
        s.send([b"x"])
    s.close()


def test_deadlines_expire_what_is_not_done_and_skip_what_is():
    class Item:
        def __init__(self, when: float) -> None:
            self.deadline, self.done, self.expired = when, False, threading.Event()

        def expire(self) -> None:
            self.expired.set()

    d = Deadlines("test-deadlines")
    now = time.monotonic()
    late, met = Item(now + 0.05), Item(now + 0.01)
    met.done = True  # done before its time: never expired
    d.add(late)
    d.add(met)
    assert late.expired.wait(10)
    assert not met.expired.is_set()
    d.close()


def test_deadlines_drop_what_was_done_early_when_the_heap_grows():
    class Item:
        def __init__(self) -> None:
            self.deadline, self.done = time.monotonic() + 3600, True

        def expire(self) -> None:
            raise AssertionError("a done item expired")

    d = Deadlines("test-deadlines")
    for _ in range(10_000):
        d.add(Item())
    assert len(d) < 4200  # compacted as it reached 4096
    d.close()


def test_a_sender_is_backlogged_while_a_frame_waits_on_the_socket_and_not_after(pair):
    """``backlogged`` (what the data connection's watcher reads: worker/datapath/dataconn.py ``_watch``): a frame
    the socket cannot take at once waits in the sender until the peer reads; once it did, no backlog."""
    a, b = pair
    sender = wire.Sender(a, "test", lambda why: None)
    try:
        sender.send([b"s" * 100])
        assert not sender.backlogged  # taken at once
        big = bytes(32 << 20)  # more than both buffers hold
        sender.send([big])
        assert sender.backlogged
        got = wire.read_exact(b, 100 + len(big))
        assert bytes(got[:100]) == b"s" * 100 and not any(got[100:])
        deadline = time.monotonic() + 30
        while sender.backlogged and time.monotonic() < deadline:  # the writer thread ends the frame as it can
            time.sleep(0.001)
        assert not sender.backlogged
    finally:
        sender.close()
