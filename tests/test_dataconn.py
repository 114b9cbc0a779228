"""The data connection (worker/datapath/dataconn.py, server/datapath/dataconn.py): one per (worker, server process),
calls as frames.

One connection for all the shards of a process, every bad frame refused
with a status naming what was expected and received (nothing changes), a
lost connection made again (the calls wait for it), and no thread left once
the client and the servers closed. In-process servers on loopback ports (one process: one data port
for all of them); ``shm=False`` so that the same-host path does not come
first.
"""

from __future__ import annotations

import contextlib
import gc
import io
import socket
import threading
import time
import weakref

import grpc
import pytest
import torch

import shardps
from shardps.protos import dataconn as wire
from shardps.protos import env
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.worker.datapath import dataconn
from shardps.worker.datapath.dataconn import ConnPath, FrameError


def test_one_connection_serves_every_shard_of_a_process(make_cluster):
    cluster = make_cluster(4)  # four shards in this process: one data port
    with shardps.connect(cluster.addresses, shm=False) as client:
        client.register({"w": torch.zeros(4000)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        conns = {id(p.conn) for p in client.paths if isinstance(p, ConnPath)}
        assert len(conns) == 1 and all(isinstance(p, ConnPath) for p in client.paths)
        assert len({p.route for p in client.paths}) == 4
        client.push({"w": torch.ones(4000)}, step=0)
        assert torch.equal(client.pull(min_versions=1)["w"], -torch.ones(4000))
    assert sum(s.job.pushes_total for s in cluster.stores) == 4


def test_a_token_cluster_takes_the_connection(make_cluster):
    cluster = make_cluster(2, security=Security(token="sesame"))
    with shardps.connect(cluster.addresses, shm=False, security=Security(token="sesame")) as client:
        client.register({"w": torch.zeros(600)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert [type(p) for p in client.paths] == [ConnPath, ConnPath]
        client.push({"w": torch.ones(600)}, step=0)
        assert torch.equal(client.pull(min_versions=1)["w"], -torch.ones(600))


@pytest.fixture
def one_shard(make_cluster):
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, shm=False, timeout=5.0)
    client.register({"w": torch.randn(4, 5)}, shardps.optim.SGD(lr=0.5), sync="bsp")
    path = client.paths[0]
    assert isinstance(path, ConnPath)
    yield cluster.stores[0], path, client
    client.close()


def _message(worker_id=0, name="w", nbytes=80, offset=0, **kw) -> bytes:
    return ps_pb2.PushRequest(worker_id=worker_id, step=0, shm=wire.FRAME_SEGMENT, last=True, **kw,
                              chunk=ps_pb2.Chunk(name=name, offset=0, dtype=ps_pb2.FLOAT32, shape=[4, 5],
                                                 shm_offset=offset, shm_bytes=nbytes)).SerializeToString()


def _refused(code, fn, *fragments):
    with pytest.raises(FrameError) as err:
        fn()
    assert err.value.code() == code, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())


def test_bad_frames_are_refused_with_what_was_expected_and_received_and_change_nothing(one_shard):
    store, path, _ = one_shard
    conn, route = path.conn, path.route
    before = store.state_hash()
    bytes80 = memoryview(bytes(80))

    def push(msgs, extents=(), buffer_bytes=80, r=route):
        return conn.call(wire.PUSH, r, wire.joined(msgs), list(extents), buffer_bytes, 5.0)

    bad = grpc.StatusCode.INVALID_ARGUMENT
    _refused(bad, lambda: push([_message()]), "'w'", "expected its bytes [0, 80)", "received none")
    _refused(bad, lambda: push([_message()], [(0, bytes80[:40])]), "'w'", "[0, 80)", "received [0, 40)")
    _refused(bad, lambda: push([_message(offset=16)], [(0, bytes80)], 96), "'w'", "[16, 96)", "received [0, 80)")
    _refused(bad, lambda: push([_message(nbytes=40)], [(0, bytes80[:40])]), "'w'")  # short of the part
    _refused(grpc.StatusCode.NOT_FOUND, lambda: push([_message(name="nope")], [(0, bytes80)]), "nope")
    _refused(bad, lambda: push([b"\xff\xff not a message"], [(0, bytes80)]), "does not parse")
    _refused(grpc.StatusCode.PERMISSION_DENIED, lambda: push([_message(worker_id=7)], [(0, bytes80)]),
             "worker 0", "worker 7")
    _refused(grpc.StatusCode.UNAVAILABLE, lambda: push([_message()], [(0, bytes80)], r=route + 1000),
             f"route {route + 1000}")
    # A stream whose second message names an unknown tensor: refused whole, the first part not applied.
    first = ps_pb2.PushRequest(worker_id=0, step=0, shm=wire.FRAME_SEGMENT, ends_with_last=True, chunk=ps_pb2.Chunk(
        name="w", offset=0, dtype=ps_pb2.FLOAT32, shape=[4, 5], shm_offset=0, shm_bytes=80)).SerializeToString()
    parts = iter([(first, [(0, bytes80)]), (_message(name="nope", ends_with_last=True), [])])
    _refused(grpc.StatusCode.NOT_FOUND, lambda: conn.stream(route, parts, 80, 5.0), "nope")
    # A stream that ends before its last message: nothing of it applied.
    parts = iter([(first, [(0, bytes80)])])
    _refused(bad, lambda: conn.stream(route, parts, 80, 5.0), "ended before its last message")
    assert store.state_hash() == before and store.job.pushes_total == 0
    push([_message()], [(0, memoryview(torch.ones(20).numpy()).cast("B"))])  # whole and as named: taken
    assert store.job.pushes_total == 1


def test_a_frame_after_its_stream_ended_is_refused(one_shard):
    store, path, _ = one_shard
    conn = path.conn
    call, c = conn._begin(None)
    msg = ps_pb2.PushRequest(worker_id=0, step=0, shm=wire.FRAME_SEGMENT, last=True, chunk=ps_pb2.Chunk(
        name="w", offset=0, dtype=ps_pb2.FLOAT32, shape=[4, 5], shm_offset=0, shm_bytes=80)).SerializeToString()
    conn._send(wire.PUSH_END, call, path.route, wire.joined([msg]), [(0, memoryview(bytes(80)))], 80, 5.0)
    conn._wait(call, c, 5.0, "push")
    assert store.job.pushes_total == 1
    before = store.state_hash()
    c2 = dataconn._Call(None)
    with conn._mu:
        conn._calls[call] = c2
    conn._send(wire.PUSH_PART, call, path.route, wire.joined([msg]), [(0, memoryview(bytes(80)))], 80, 5.0)
    _refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: conn._wait(call, c2, 5.0, "push"),
             f"call {call} came after that call ended")
    assert store.state_hash() == before and store.job.pushes_total == 1


@pytest.mark.parametrize("how", ["torn", "past-the-buffer", "bad-magic", "huge-control"])
def test_a_frame_that_breaks_the_protocol_ends_the_connection_and_the_next_call_waits_for_a_new_one(one_shard, how):
    store, path, client = one_shard
    conn = path.conn
    before = store.state_hash()
    msg = wire.joined([_message()])
    nctl = sum(len(m) for m in msg)
    head = {"torn": wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PUSH, 999, path.route, 5000, nctl, 1, 80),
            "past-the-buffer": wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PUSH, 999, path.route, 5000, nctl, 1, 40),
            "bad-magic": wire.REQUEST.pack(b"XXXX", wire.PUSH, 999, path.route, 5000, nctl, 1, 80),
            "huge-control": wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PUSH, 999, path.route, 5000,
                                              wire.MAX_CTL + 1, 1, 80)}[how]
    conn.sender.send([head + b"".join(msg) + wire.EXTENT.pack(0, 80) + bytes(30)])  # in order with any other frame
    if how == "torn":
        conn.sock.shutdown(socket.SHUT_WR)  # the worker's end stops mid-frame
    conn._thread.join(10)
    assert not conn._thread.is_alive() and conn.error  # the server closed it
    assert not client.paths.usable(0) or client.paths[0].conn is not conn  # (or made again already)
    assert store.state_hash() == before and store.job.pushes_total == 0
    w = store.reader.weights("w")[0]
    client.push({"w": torch.ones(4, 5)}, step=0)  # waits for the connection made again
    assert isinstance(client.paths[0], ConnPath) and client.paths[0].conn is not conn
    assert torch.equal(client.pull(min_versions=1)["w"], w - 0.5)


def test_a_lost_connection_is_made_again_and_the_calls_give_the_same_result(make_cluster):
    w, grad = torch.randn(600), torch.randn(600)
    got = []
    for lose in (False, True):
        cluster = make_cluster(2)
        with shardps.connect(cluster.addresses, part_bytes=1024, shm=False) as client:
            client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
            client.push({"w": grad}, step=0)
            conn = client.paths[1].conn
            if lose:
                conn.sock.shutdown(socket.SHUT_RD)  # the connection ends under the reader (the shards stay)
                conn._thread.join(10)
                assert all(not client.paths.usable(i) or client.paths[i].conn is not conn for i in (0, 1))
            client.push({"w": grad}, step=1)
            got.append(client.pull(min_versions=2)["w"])
            assert (client.paths[0].conn is conn) == (not lose) and client.paths[0].conn is client.paths[1].conn
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0], w - grad - grad)


def test_a_lost_connection_is_made_again_where_the_shards_say_and_they_take_it(make_cluster):
    cluster = make_cluster(2)
    w, grad = torch.randn(600), torch.randn(600)
    with shardps.connect(cluster.addresses, part_bytes=1024, shm=False) as client:
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        conn = client.paths[0].conn
        conn.sock.shutdown(socket.SHUT_RD)  # the link drops under the reader; the server process stays
        conn._thread.join(10)
        made = [client.paths.ready(i, 30.0) for i in range(2)]  # each shard asked (Connect), one connection made
        assert [type(p) for p in made] == [ConnPath, ConnPath] and list(client.paths) == made
        assert made[0].conn is not conn and made[0].conn is made[1].conn
        client.push({"w": grad}, step=0)
        assert torch.equal(client.pull(min_versions=1)["w"], w - grad)
        assert client.paths.revive() is None  # nothing lost


def test_a_connection_that_cannot_be_made_fails_the_call_that_waited_for_it_and_is_tried_again(
        make_cluster, monkeypatch):
    cluster = make_cluster(1)
    with shardps.connect(cluster.addresses, shm=False) as client:
        client.register({"w": torch.zeros(6)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        conn = client.paths[0].conn
        tries = []

        def refused(*args, **kwargs):
            tries.append(args[:2])
            raise dataconn.ConnectFailed("no data connection: refused (a test)")

        real = dataconn.DataConn.open
        monkeypatch.setattr(dataconn.DataConn, "open", refused)
        conn.sock.shutdown(socket.SHUT_RD)
        conn._thread.join(10)
        with pytest.raises(FrameError) as err:
            client.paths.ready(0, 0.5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shard 0: no data connection (" in err.value.details() and "refused (a test)" in err.value.details()
        assert len(tries) == 1 and client.paths.revive() is None  # not again before its back-off (1 s)
        monkeypatch.setattr(dataconn.DataConn, "open", real)
        client.push({"w": torch.ones(6)}, step=0)  # waits for the next attempt, which makes it
        assert client.paths.usable(0)
        assert torch.equal(client.pull(min_versions=1)["w"], -torch.ones(6))


def test_no_thread_is_left_behind(make_cluster):
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses, shm=False) as client:
        client.register({"w": torch.zeros(600)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        client.push({"w": torch.ones(600)}, step=0)
        client.pull(min_versions=1)
        assert any(t.name.startswith("shardps-data-") for t in threading.enumerate())
    cluster.stop()
    assert [t.name for t in threading.enumerate() if t.name.startswith("shardps-data-")] == []


def test_a_pull_lands_in_the_destination_itself_where_its_dtype_is_the_wires(make_cluster, monkeypatch):
    """Read straight into ``out``'s own storage, and not held once read (a streamed worker frees it)."""
    cluster = make_cluster(2)
    landed: list[torch.Tensor] = []
    read = dataconn.ConnPath.read

    def seen(self, chunk, segment):  # type: ignore[no-untyped-def]
        if chunk.shm_offset in self._landed:
            landed.append(self._landed[chunk.shm_offset])
        return read(self, chunk, segment)

    monkeypatch.setattr(dataconn.ConnPath, "read", seen)
    with shardps.connect(cluster.addresses, shm=False, part_bytes=1024) as client:
        w = torch.randn(40, 25)
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        out = torch.empty(40, 25)
        client.pull(out={"w": out})
        assert torch.equal(out, w)
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * 4
        assert landed and all(lo <= t.data_ptr() < hi for t in landed)  # read into ``out``'s own storage
        assert sum(t.numel() for t in landed) == 40 * 25
        assert not any(p._landed for p in client.paths)  # nothing of it kept once read
        landed.clear()
        half = torch.empty(40, 25, dtype=torch.bfloat16)  # another dtype than the wire's: read, then cast
        client.pull(out={"w": half})
        assert torch.equal(half, w.to(torch.bfloat16)) and not landed


@pytest.mark.fault
def test_an_answer_sent_from_the_weights_keeps_its_version_when_a_step_comes_before_the_worker_read_it(make_cluster):
    """A Pull's answer goes from the weights themselves (Reader.read_lent); what the sockets did not take waits
    in the server's sender. A step that comes first has that rest copied before it changes the weights: the
    worker reads the version it asked for, bit for bit."""
    from shardps.server.datapath.dataconn import DataPort

    cluster = make_cluster(1)
    store, reader = cluster.stores[0], cluster.stores[0].reader
    a = shardps.connect(cluster.addresses, worker_id=0, num_workers=2, shm=False, timeout=20.0)
    b = shardps.connect(cluster.addresses, worker_id=1, num_workers=2, shm=False, timeout=20.0)
    try:
        w = torch.randn(8 << 20)  # 32 MB: more than both sockets' buffers hold
        for c in (a, b):
            c.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp")
        sender = next(p._conns[0][-1] for p in DataPort._ports.values() if p._conns.get(0)).sender
        lent = reader.lent_answers_total
        with a.paths[0].conn._reading:  # worker 0's connection reads the answer's head, then waits here
            pull = a.pull_async()
            with store._cond:  # answered (as far as the socket took it) and the answering thread done
                assert store._cond.wait_for(lambda: reader.lent_answers_total == lent + 1 and not reader.reading,
                                            10)
            assert len(reader._sending) == 1 and sender.detached_frames == 0  # its rest waits in the sender
            b.push({"w": torch.ones(8 << 20)}, step=0)  # asp: a step at once, which detaches the answer first
            assert not reader._sending and sender.detached_frames == 1 and reader.shared_copies_total == 0
            parts = store.reader.weights("w")
            assert torch.equal(torch.cat([parts[k] for k in sorted(parts)]), w - 1)
        assert torch.equal(pull.result()["w"], w)  # version 0's weights, as the pull asked
    finally:
        a.close()
        b.close()


def test_an_answer_that_cannot_be_sent_never_waits_for_the_connections_reading_thread(make_cluster, monkeypatch):
    """An answer sent by another connection's thread (a parked Pull its push released) that finds the worker gone
    shuts the connection and returns: it does not join the connection's reading thread, which may be in a step
    waiting for that very answer's read of the weights to end (the lent payload is closed once ``answer``
    returns). The reading thread, held here inside a push, ends at the shut socket once it goes on."""
    from shardps.server.datapath.dataconn import DataPort
    from shardps.server.service import WorkersServicer

    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False, timeout=20.0)
    inside, release = threading.Event(), threading.Event()
    push_frames = WorkersServicer.push_frames

    def held(self, *args, **kw):
        inside.set()
        assert release.wait(30)
        return push_frames(self, *args, **kw)

    try:
        client.register({"w": torch.zeros(64)}, shardps.optim.SGD(lr=1.0), sync="asp")
        conn = next(p._conns[0][-1] for p in DataPort._ports.values() if p._conns.get(0))
        monkeypatch.setattr(WorkersServicer, "push_frames", held)
        pushing = threading.Thread(target=lambda: client.push({"w": torch.ones(64)}, step=0))
        pushing.start()
        assert inside.wait(20)  # the connection's reading thread is inside the push, held

        def broken(frame, lent=None):
            raise OSError(32, "Broken pipe")

        monkeypatch.setattr(conn.sender, "send", broken)
        answering = threading.Thread(target=conn.answer, args=(wire.PULL, 99, wire.OK, [b""]))
        answering.start()
        answering.join(20)
        assert not answering.is_alive()  # returned with the reading thread still held
        assert conn._thread.is_alive()
    finally:
        release.set()
        pushing.join(30)
        client.close()
    conn._thread.join(20)
    assert not conn._thread.is_alive() and conn.closed  # it ended at the shut socket and closed the connection


@pytest.mark.parametrize("carry", [False, True])
def test_a_call_the_connections_end_failed_during_its_send_ends_once_and_is_not_raised_again(make_cluster,
                                                                                         monkeypatch, carry):
    """The connection ends between a call's registration and its send: the reading thread ends the call (its
    ``then``: UNAVAILABLE, which retries it) and the send then fails. ``submit`` must not raise as well, or the
    caller makes the call a second time beside the retry ``then`` began (two pulls writing one shard)."""
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False, timeout=20.0)
    try:
        client.register({"w": torch.zeros(64)}, shardps.optim.SGD(lr=1.0), sync="asp")
        conn = client.paths[0].conn
        ended: list[tuple[str, int]] = []

        def send_after_the_end(frame, lent=None):
            conn.sock.shutdown(socket.SHUT_RDWR)  # the server goes: the reading thread ends every call it holds
            conn._thread.join(20)
            assert not conn._thread.is_alive() and ended
            raise OSError(32, "Broken pipe")

        monkeypatch.setattr(conn.sender, "send", send_after_the_end)
        carried = dataconn._Call(None, then=lambda c: ended.append(("pull", c.status))) if carry else None
        conn.submit(wire.PUSH_PULL if carry else wire.PULL, 0, (b"",), (), 0, 20.0,
                    lambda c: ended.append(("call", c.status)), carry=carried)
        assert sorted(ended) == ([("call", -1), ("pull", -1)] if carry else [("call", -1)])
        with pytest.raises(FrameError) as err:  # a call made after the end is refused at once, as before
            conn.submit(wire.PULL, 0, (b"",), (), 0, 20.0, lambda c: ended.append(("late", c.status)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and ("late", -1) not in ended
    finally:
        client.close()


def test_an_answer_that_does_not_parse_fails_its_call_internal_and_ends_the_connection(make_cluster):
    """A Push's answer whose control does not parse ends the call INTERNAL (as a gRPC answer that does not
    deserialize) through its ``then``, and the connection, instead of leaving the call's owner waiting."""
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False, timeout=20.0)
    try:
        client.register({"w": torch.zeros(64)}, shardps.optim.SGD(lr=1.0), sync="asp")
        path = client.paths[0]
        got: list[tuple[object, FrameError | None]] = []
        c = dataconn._Call(None, then=path._pushed(lambda answer, error: got.append((answer, error))))
        c.status, c.ctl = wire.OK, b"\x0a\xff"  # field 1, 255 bytes long, and no bytes
        c.end()
        assert len(got) == 1 and got[0][0] is None and got[0][1] is not None
        assert got[0][1].code() == grpc.StatusCode.INTERNAL and "does not parse" in got[0][1].details()
        assert "protocol error" in path.conn.error
    finally:
        client.close()


def test_a_connection_that_ends_as_its_shard_is_put_on_it_is_made_again(make_cluster, monkeypatch):
    """A connection made again (``revive``) or found after a fail-over (``moved``) that ends as its shard is put
    on it: its end may have found no path on it, so the shard is marked lost there (made again), not left on a
    dead connection with every call UNAVAILABLE."""
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False, timeout=20.0)
    try:
        client.register({"w": torch.zeros(64)}, shardps.optim.SGD(lr=1.0), sync="asp")
        paths = client.paths
        conn = paths[0].conn
        made = dataconn.ConnPath

        def ends_meanwhile(c, *args):
            path = made(c, *args)
            c.close_after_failure("the server went")  # after the path was made, before it is listed
            return path

        monkeypatch.setattr(dataconn, "ConnPath", ends_meanwhile)
        key = (cluster.addresses[0].rsplit(":", 1)[0], int(conn.where.rsplit(":", 1)[1]))
        assert not paths._place(0, key, conn.token, paths[0].route)
        assert 0 in paths._lost and not paths.usable(0)
        monkeypatch.setattr(dataconn, "ConnPath", made)
        again = paths.ready(0, 30.0)
        assert isinstance(again, made) and again.conn is not conn and not again.conn.error
    finally:
        client.close()


def test_a_connection_made_again_as_the_client_closes_stops_quietly(make_cluster):
    """The thread that makes a lost connection again may ask a shard (``Workers.Connect``) after the client
    closed its channels (it closes them, then joins that thread): it stops, and raises nothing."""
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False)
    try:
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=1.0), sync="asp")
        client.transport.close()
        client.paths._revive_each([0])  # what that thread does next
    finally:
        client.close(leave=False)  # (its channels are closed: no goodbye)


def test_a_pull_abandoned_is_not_asked_again_after_a_frame_of_it_fails(make_cluster, monkeypatch):
    """Once the step's push failed and its pull was abandoned, a shard's frame that fails UNAVAILABLE (or whose
    carried Pull was not made) ends that shard with the failure; no retry begins (``abandon`` waits only for the
    calls it knows of: a retry could write into the weights after it returned)."""
    from shardps.worker.datapath.dataconn import NotMade
    from shardps.worker.datapath.pull import PullInFlight

    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False, timeout=20.0)
    try:
        client.register({"w": torch.zeros(64)}, shardps.optim.SGD(lr=1.0), sync="asp")
        retried: list[list[int]] = []
        for error in (FrameError(grpc.StatusCode.UNAVAILABLE, "the connection ended"),
                      NotMade(grpc.StatusCode.ABORTED, "not made")):
            pull = PullInFlight(client, ["w"]).start_later()
            monkeypatch.setattr(pull, "_threaded", retried.append)
            monkeypatch.setattr(pull, "_soon", lambda shard: retried.append([shard]) or True)
            pull.abandon()  # the shard not begun: ended at once
            del pull._ended[0]  # as if its frame were out when the push failed
            if isinstance(error, NotMade):
                pull._carried[0] = "pushed"
                pull._answered_carried(0, client.paths[0], "", None, error)
            else:
                pull._answered_soon(0, client.paths[0], "", None, error)
            assert pull._ended[0] is error and retried == []
    finally:
        client.close()


def _server_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("shardps-data-pull")}


def _parked_pull(client, store):
    """``client``'s pull of version 1, which must wait for the round: parked on ``store`` (counted as a waiting
    Pull), held by no thread."""
    before = _server_threads()
    pull = client.pull_async(min_versions=[1])
    with store._cond:
        assert store._cond.wait_for(lambda: store.job.waiting == 1, 10)
        assert len(store.path.parked) == 1
    assert _server_threads() == before and not pull.done()
    return pull


@pytest.mark.fault
def test_a_pull_that_must_wait_parks_without_a_thread_and_the_last_push_of_its_round_answers_it(make_cluster):
    cluster = make_cluster(1)
    store = cluster.stores[0]
    a = shardps.connect(cluster.addresses, worker_id=0, num_workers=2, shm=False, timeout=20.0)
    b = shardps.connect(cluster.addresses, worker_id=1, num_workers=2, shm=False, timeout=20.0)
    try:
        w = torch.randn(300)
        for c in (a, b):
            c.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert isinstance(a.paths[0], ConnPath)
        a.push({"w": torch.ones(300)}, step=0)
        pull = _parked_pull(a, store)  # the round waits for worker 1
        b.push({"w": 3 * torch.ones(300)}, step=0)  # the round's last push: its thread answers the parked Pull
        got = pull.result()["w"]
        assert torch.equal(got, w - 2 * torch.ones(300)) and store.job.waiting == 0
        assert len(store.path.parked) == 0
        pulls = store.reader.pulls_total
        assert torch.equal(b.pull(min_versions=[1])["w"], got)
        # Both workers' Pulls of version 1 were answered from one framing of its weights, sent from the weights
        # themselves (Reader.read_lent): no copy.
        r = store.reader
        assert r.pulls_total == pulls + 1 and len(r.lent) == 1 and not r.shared and r.shared_copies_total == 0
    finally:
        a.close()
        b.close()


@pytest.mark.fault
def test_a_parked_pull_past_its_deadline_is_answered_with_what_it_waited_for(make_cluster):
    """The server's wait ends at its limit (1 s here), well before the worker's own deadline (5 s): the
    answer says what it waited for however busy the machine (with the deadline's tenth as the only
    margin, 0.15 s of a 1.5 s call, a loaded machine let the worker's deadline come first)."""
    cluster = make_cluster(1, max_wait_s=1.0)
    store = cluster.stores[0]
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2, shm=False, timeout=5.0,
                         recovery_timeout=0.5) as a:
        a.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        a.push({"w": torch.ones(8)}, step=0)
        with pytest.raises(shardps.ShardError) as err:
            a.pull(min_versions=[1])
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "at version 0" in err.value.details and "for version 1" in err.value.details
        assert store.job.waiting == 0 and len(store.path.parked) == 0


@pytest.mark.fault
def test_a_parked_pull_of_a_stopping_shard_is_answered_unavailable(make_cluster):
    cluster = make_cluster(1)
    store = cluster.stores[0]
    a = shardps.connect(cluster.addresses, worker_id=0, num_workers=2, shm=False, timeout=20.0,
                        recovery_timeout=0.5)
    try:
        a.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        a.push({"w": torch.ones(8)}, step=0)
        pull = a.pull_async(min_versions=[1])
        with store._cond:
            assert store._cond.wait_for(lambda: store.job.waiting == 1, 10)
        store.job.close()  # what a stopping server does first: every wait ends
        with pytest.raises(shardps.ShardError) as err:
            pull.result()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details
    finally:
        a.close(leave=False)


def test_a_window_of_pushes_and_their_pulls_run_on_the_connections_threads(make_cluster, monkeypatch):
    cluster = make_cluster(4)
    with shardps.connect(cluster.addresses, shm=False, part_bytes=1024) as client:
        w = torch.randn(2000)
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        pool = client.transport._pool
        handed: list[object] = []
        real = pool.submit
        monkeypatch.setattr(pool, "submit", lambda fn, *a, **kw: handed.append(fn) or real(fn, *a, **kw))
        for step in range(3):
            pull = client.pull_async(later=True)
            client.push({"w": torch.ones(2000)}, step=step, window=2, then=pull)
            w = w - 1
            assert torch.equal(pull.result()["w"], w)
        assert handed == []  # no push and no pull needed a transport thread


def hello(listener: socket.socket) -> socket.socket:
    """A fake data port's side of a connection's start: accept it, read the hello, acknowledge it."""
    sock, _ = listener.accept()
    wire.read_exact(sock, wire.HELLO.size)
    sock.sendall(wire.ACK.pack(wire.ACK_MAGIC, 0))
    return sock


class SilentServer:
    """A data port that takes the hello and then answers nothing but, if ``pings``, PING frames: a server process
    stopped (SIGSTOP) after its kernel accepted the connection, or one whose calls are only slow."""

    def __init__(self, pings: bool) -> None:
        self.pings, self.pinged = pings, 0
        self.ping_read = threading.Event()  # set once a PING frame was read (after ``pinged`` counts it)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with hello(self.listener) as sock:
            try:
                while True:
                    _, kind, call, _, _, nctl, next_, _ = wire.REQUEST.unpack(wire.read_exact(sock, wire.REQUEST.size))
                    wire.read_exact(sock, nctl + next_ * wire.EXTENT.size)
                    if kind == wire.PING:
                        self.pinged += 1
                        self.ping_read.set()
                        if self.pings:
                            sock.sendall(wire.ANSWER.pack(wire.ANSWER_MAGIC, wire.PING, call, wire.OK, 0, 0))
            except (wire.Torn, OSError):
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


@pytest.mark.fault
def test_a_server_that_answers_no_ping_ends_the_connection_and_its_waiting_call_fails_unavailable(monkeypatch):
    monkeypatch.setenv(env.KEEPALIVE_S, "0.2")
    server = SilentServer(pings=False)
    ended: list[str] = []
    conn = dataconn.DataConn.open("127.0.0.1", server.port, b"t" * 16, 0, 60.0, ended.append)
    assert conn is not None
    try:
        with pytest.raises(FrameError) as e:  # its deadline is a minute away: the unanswered ping ends it
            conn.call(wire.PUSH, 0, [b"x"], [], 0, 60.0)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "answered no ping within 0.1s" in e.value.details()
        # the worker gave up 0.1 s after its ping went out: this process's server thread may read it later
        assert server.ping_read.wait(30) and server.pinged == 1 and ended and "no ping" in ended[0]
    finally:
        conn.close()
        server.close()


@pytest.mark.fault
def test_a_server_that_answers_its_pings_keeps_the_connection_and_the_call_ends_at_its_deadline(monkeypatch):
    monkeypatch.setenv(env.KEEPALIVE_S, "2")  # an answer within 1 s, on a loaded machine too
    server = SilentServer(pings=True)
    conn = dataconn.DataConn.open("127.0.0.1", server.port, b"t" * 16, 0, 60.0, lambda why: None)
    assert conn is not None
    try:
        with pytest.raises(FrameError) as e:
            conn.call(wire.PUSH, 0, [b"x"], [], 0, 7.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert server.pinged >= 1 and not conn.error  # the connection serves on
    finally:
        conn.close()
        server.close()


def until(probe, timeout: float = 30.0) -> bool:
    """Whether ``probe()`` came true within ``timeout`` (looked at each millisecond: a count in the kernel, or
    a field another thread sets, that nothing signals)."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class SlowServer:
    """A data port that is slow one way: ``trickle`` answers the first of two calls with a long frame whose
    bytes go a piece each time the test says (``go``); ``slow_read`` reads the first call's long request a
    piece each time instead. Then it reads on (the worker's pings, queued behind that frame or seen on the
    way to the calls, answered only now) and answers the calls once it answered a ping: a long frame on a slow
    link, with the frames behind it waiting."""

    def __init__(self, pieces: int, piece_bytes: int, *, slow_read: bool = False, buffers: int = 0) -> None:
        self.pieces, self.piece_bytes, self.slow_read = pieces, piece_bytes, slow_read
        self.pinged = 0
        self.go, self.first = threading.Semaphore(0), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        if buffers:  # the accepted connection's receive buffer, of a fixed size
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _request(self, sock: socket.socket, calls: list[tuple[int, int]]) -> None:
        """One request frame: a ping is owed an answer, a call is noted (its extents read slowly, or not)."""
        _, kind, call, _, _, nctl, next_, _ = wire.REQUEST.unpack(wire.read_exact(sock, wire.REQUEST.size))
        wire.read_exact(sock, nctl)
        sizes = [wire.EXTENT.unpack(wire.read_exact(sock, wire.EXTENT.size))[1] for _ in range(next_)]
        if kind == wire.PING:
            self.pinged += 1
            return
        calls.append((kind, call))
        self.first.set()
        scratch = memoryview(bytearray(self.piece_bytes))
        slow = self.pieces if self.slow_read else 0
        for nbytes in sizes:
            while nbytes:
                if slow:  # the first pieces one a go, the rest at once
                    slow -= 1
                    if not self.go.acquire(timeout=60):
                        raise OSError("no go")
                k = min(nbytes, len(scratch))
                wire.fill(sock, scratch[:k])
                nbytes -= k

    def _serve(self) -> None:
        with hello(self.listener) as sock:
            try:
                calls: list[tuple[int, int]] = []
                while len(calls) < (1 if self.slow_read else 2):
                    self._request(sock, calls)
                if not self.slow_read:
                    kind, call = calls[0]
                    sock.sendall(wire.ANSWER.pack(wire.ANSWER_MAGIC, kind, call, wire.OK, 0,
                                                  self.pieces * self.piece_bytes))
                    for _ in range(self.pieces):
                        if not self.go.acquire(timeout=60):
                            return
                        sock.sendall(b"w" * self.piece_bytes)
                    calls = calls[1:]
                while not self.pinged:
                    self._request(sock, calls)
                for _ in range(self.pinged):
                    sock.sendall(wire.ANSWER.pack(wire.ANSWER_MAGIC, wire.PING, 0, wire.OK, 0, 0))
                for kind, call in calls:
                    sock.sendall(wire.ANSWER.pack(wire.ANSWER_MAGIC, kind, call, wire.OK, 0, 0))
                while True:
                    self._request(sock, calls)
                    if self.pinged:
                        sock.sendall(wire.ANSWER.pack(wire.ANSWER_MAGIC, wire.PING, 0, wire.OK, 0, 0))
                        self.pinged = 0
            except (wire.Torn, OSError):
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


def driven_by_the_watcher(monkeypatch, conn: dataconn.DataConn, server: SlowServer, moving: int) -> list[int]:
    """Each look of ``conn``'s watcher, once it pinged, lets ``server`` send or read one more piece, and waits
    until the kernel's count ``moving`` (0: received, 1: acknowledged by the server) says it moved, before
    the look reads it; after the last piece, until the calls are answered. So each look finds one more piece
    moved, whatever the machine's speed. The pieces let go so far (a list of one)."""
    real = dataconn.moved
    sent = [0]

    def count(sock) -> int:
        counts = real(sock)
        return (1 << 62) if counts is None else counts[moving]  # None: closed (the test ended first)

    def moved(sock):
        if sock is conn.sock and (conn._ping_at or sent[0]):
            if sent[0] < server.pieces:
                before = count(sock)
                sent[0] += 1
                server.go.release()
                assert until(lambda: count(sock) > before)
            else:  # the frame is through: the pings' answers, and the calls', come before the watcher looks again
                assert until(lambda: not conn._calls)
        return real(sock)

    monkeypatch.setattr(dataconn, "moved", moved)
    return sent


@pytest.mark.fault
def test_a_stopped_server_whose_kernel_takes_frames_sent_one_by_one_ends_the_connection(monkeypatch):
    """The server process reads nothing after the hello (stopped: its kernel still acknowledges what comes,
    until its receive buffer is full). Before each look of the watcher another small frame goes and is
    acknowledged: bytes acknowledged without a backlog at this end are not the server's life, so the ping
    goes unanswered and the connection ends, as with nothing sent, not at the call's deadline."""
    monkeypatch.setenv(env.KEEPALIVE_S, "0.4")
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def stopped() -> None:
        accepted.append(hello(listener))  # read no more: a stopped process

    t = threading.Thread(target=stopped, daemon=True)
    t.start()
    conn = dataconn.DataConn.open("127.0.0.1", listener.getsockname()[1], b"t" * 16, 0, 60.0, lambda why: None)
    assert conn is not None
    real, looks = dataconn.moved, [0]

    def moved(sock):  # another small frame before each look, in the count the look reads
        if sock is conn.sock and not conn.error:
            looks[0] += 1
            before = (real(sock) or (0, 0, 0))[1]
            with contextlib.suppress(OSError):
                conn.sender.send([wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PUSH, 1 << 40, 0, 1, 400, 0, 0),
                                  b"c" * 400])
                assert until(lambda: conn.error or (real(sock) or (1 << 62, 1 << 62, 0))[1] > before)
        return real(sock)

    monkeypatch.setattr(dataconn, "moved", moved)
    try:
        with pytest.raises(FrameError) as e:  # its deadline is a minute away: the unanswered ping ends it
            conn.call(wire.PUSH, 0, [b"x"], [], 0, 60.0)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "answered no ping within 0.2s" in e.value.details()
        assert looks[0] <= 12  # a ping after a keepalive (4 looks), its answer given up half of one later (2)
    finally:
        conn.close()
        t.join(10)
        for sock in accepted:
            sock.close()
        listener.close()


@pytest.mark.fault
def test_a_long_answer_whose_bytes_keep_coming_is_not_taken_for_a_stopped_server(monkeypatch):
    """Two calls wait; the first one's answer is slow to come (a long frame on a slow link), the worker's pings
    and the second one's answer queued behind it. Its bytes start once the worker pinged, and come a piece per
    look of the worker's watcher, for three keepalives. Bytes moved, so the connection is not ended for a
    stopped server (it was, half a keepalive after the frame's head), and both calls get their answers."""
    monkeypatch.setenv(env.KEEPALIVE_S, "0.4")
    pieces = 12  # one a look, a look each 0.1 s: 1.2 s, three keepalives
    server = SlowServer(pieces, 1000)
    conn = dataconn.DataConn.open("127.0.0.1", server.port, b"t" * 16, 0, 60.0, lambda why: None)
    assert conn is not None
    sent = driven_by_the_watcher(monkeypatch, conn, server, 0)
    long, short = bytearray(pieces * 1000), bytearray(8)
    results: list[tuple[bytes, int]] = []
    got: list[tuple[bytes, int]] = []
    one = threading.Thread(target=lambda: results.append(conn.call(wire.PULL, 0, [b"x"], [], 0, 60.0,
                                                                   into=memoryview(long))), daemon=True)
    second = threading.Thread(target=lambda: got.append(conn.call(wire.PULL, 0, [b"y"], [], 0, 60.0,
                                                                  into=memoryview(short))), daemon=True)
    try:
        one.start()
        assert server.first.wait(30)  # the second call goes once the server has the first: it is answered second
        second.start()
        one.join(90)
        second.join(90)
        assert results == [(b"", pieces * 1000)] and bytes(long) == b"w" * (pieces * 1000) and sent[0] == pieces
        assert got == [(b"", 0)]
        assert not conn.error and not conn.closed
    finally:
        conn.close()
        server.close()


@pytest.mark.fault
def test_a_long_push_the_server_reads_slowly_is_not_taken_for_a_stopped_server(monkeypatch):
    """The worker's push is a long frame the server reads slowly (a slow link): more than the sockets' buffers
    hold, so the rest waits in the worker's sender and the ping queues behind it. Once the worker pinged, the
    server reads a piece per look of the watcher, for three keepalives, each letting more of the frame go (the
    frame is longer than the pieces by what the kernel's buffers may hold): the bytes it acknowledges move while
    this end has a backlog, so the connection is not ended for a stopped server, and the push gets its
    answer."""
    monkeypatch.setenv(env.KEEPALIVE_S, "0.4")
    pieces, piece = 12, 4 << 20  # read one a look; then the rest at once
    server = SlowServer(pieces, piece, slow_read=True, buffers=1 << 20)
    conn = dataconn.DataConn.open("127.0.0.1", server.port, b"t" * 16, 0, 60.0, lambda why: None)
    assert conn is not None
    # Buffers of a fixed size (the kernel doubles them): after the last slow piece the frame holds more than
    # they take, so each piece read lets more of it be sent and acknowledged. And no user timeout: the server's
    # window stays shut until its first piece, longer than 1.5 keepalives on a loaded machine, which the kernel
    # would end the connection for (TCP_USER_TIMEOUT, protos/dataconn.py ``keep_alive``): the watcher is tested.
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 0)
    sent = driven_by_the_watcher(monkeypatch, conn, server, 1)
    payload = memoryview(bytearray(pieces * piece + (8 << 20)))
    try:
        assert conn.call(wire.PUSH, 0, [b"x"], [(0, payload)], len(payload), 90.0) == (b"", 0)
        assert sent[0] == pieces and server.pinged >= 1  # answered before the push was (SlowServer)
        assert not conn.error and not conn.closed
    finally:
        conn.close()
        server.close()


def test_connect_answers_what_register_offered_and_a_backup_refuses_it(make_cluster):
    """Workers.Connect: the shard's primary answers the data port, the worker's token and the shard's route its
    Register answer gave; a backup (it does not serve the shard) refuses, UNAVAILABLE saying so."""
    c = make_cluster(2, replicas=2)
    with shardps.connect(c.addresses, shm=False) as client:
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=1.0), sync="asp")
        path = client.paths[0]
        a = client.transport.stub(0).Connect(ps_pb2.ConnectRequest(worker_id=client.worker_id), timeout=10)
        assert (a.data_port, a.data_token, a.data_route) == (
            int(path.conn.where.rsplit(":", 1)[1]), path.conn.token, path.route)
    with grpc.insecure_channel(c.backup_addresses[0]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.WorkersStub(ch).Connect(ps_pb2.ConnectRequest(worker_id=0), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "backup of shard 0" in err.value.details()


@pytest.mark.fault
@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
def test_a_shard_that_fails_over_goes_on_as_frames_on_its_backups_route(make_cluster, shm):
    """shard 0's backup is promoted (ctl promote --force) after step 5: the workers fail over, and the shard's
    calls go on as frames on the route the backup's TakeOver answer gave: on the worker's connection to that
    process where it has one (frames), else on one made as it fails over (shared memory before: no connection
    to the backup's process yet); the weights equal a run without the fail-over, bit for bit."""
    from shardps.admin import run_promote
    from tests.replicas import model, train

    base = model()
    clean = train(make_cluster(2).addresses, base, 12, shm=False)
    c = make_cluster(2, replicas=2)
    seen: dict[int, list[tuple[str, int]]] = {0: [], 1: []}

    def on_step(k, step, client):
        if k == 0 and step == 5:
            assert run_promote([c.replica_addresses[1]], force=True, out=io.StringIO()) == 0
        p = client.paths[0]
        seen[k].append((type(p).__name__, getattr(p, "route", 0)))

    got = train(c.addresses, base, 12, on_step=on_step, shm=shm)
    for (exp, _), (res, failovers) in zip(clean, got):
        assert failovers == 1
        for n in exp:
            assert torch.equal(res[n], exp[n]), n
    assert c.backups[1].stats().role == "primary" and c.backups[1].job.version == 12
    for k in (0, 1):
        before, after = seen[k][0], seen[k][-1]
        assert before[0] == ("ShmConnPath" if shm else "ConnPath")
        assert after[0] == "ConnPath" and after[1] != before[1], seen[k]  # the backup's route, not the primary's


def test_a_pushed_part_is_read_into_its_staging_buffer_and_checked_there(make_cluster, monkeypatch):
    from shardps.server.service import WorkersServicer

    seen = []
    push_frames = WorkersServicer.push_frames

    def spy(self, requests, segments, landed=None):
        out = push_frames(self, requests, segments, landed)
        seen.append((landed is not None and bool(landed.regions), dict(landed.buffers) if landed else {}))
        return out

    monkeypatch.setattr(WorkersServicer, "push_frames", spy)
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses, shm=False) as client:
        w = torch.randn(50, 40)
        client.register({"w": w, "b": torch.zeros(50)}, shardps.optim.SGD(lr=0.5), sync="bsp")
        g = torch.randn(50, 40)
        client.push({"w": g, "b": torch.ones(50)}, step=0)
        assert torch.equal(client.pull(min_versions=1)["w"], w - 0.5 * g)
        assert len(seen) == 2 and all(landed and not left for landed, left in seen)  # every buffer taken
        bad = g.clone()
        bad[7, 3] = float("nan")  # read where it is applied from, and checked there: the step is skipped
        client.push({"w": bad, "b": torch.ones(50)}, step=1)
        assert torch.equal(client.pull(min_versions=2)["w"], w - 0.5 * g)
    assert sum(s.applier.skipped_steps_total for s in cluster.stores) == 2


def test_landing_takes_the_fp32_chunks_one_part_holds_and_leaves_every_other_to_the_checks():
    from types import SimpleNamespace

    from shardps.server.datapath.assembly import landing
    from shardps.server.errors import NotFound

    specs = {"w": SimpleNamespace(push_dtype=ps_pb2.FLOAT32, parts=((0, 20), (40, 60))),
             "h": SimpleNamespace(push_dtype=ps_pb2.BFLOAT16, parts=((0, 8),))}

    def lookup(name):
        if name not in specs:
            raise NotFound(name)
        return specs[name]

    def chunk(name, offset, dtype=ps_pb2.FLOAT32, encoding=ps_pb2.DENSE):
        return ps_pb2.Chunk(name=name, offset=offset, dtype=dtype, encoding=encoding)

    taken = []
    out = landing([(0, 40, chunk("w", 0)), (40, 40, chunk("w", 10)),  # one part, two chunks: both land
                   (80, 40, chunk("w", 45)),  # the second part
                   (120, 40, chunk("w", 15)),  # runs past its part
                   (160, 16, chunk("h", 0, ps_pb2.BFLOAT16)),  # not fp32
                   (176, 16, chunk("nope", 0)),  # no such tensor
                   (192, 40, chunk("w", 50, encoding=ps_pb2.TOPK)),  # compressed
                   (240, 40, chunk("w", 0)), (260, 40, chunk("w", 5))],  # bytes two chunks name
                  lookup, lambda key, n: taken.append((key, n)) or torch.zeros(n))
    assert sorted(out.regions) == [0, 40, 80]
    assert taken == [(("w", 0), 20), (("w", 40), 20)]
    first = out.take(("w", 0), 20)
    out.regions[40][:4] = memoryview(torch.tensor([2.5]).numpy()).cast("B")
    assert first[10].item() == 2.5  # the region is the part's own elements, at the chunk's offset
    assert out.take(("w", 0), 20) is not first  # taken once; then the allocator's


def test_a_steps_pull_rides_its_push_frame_and_a_refused_push_pulls_nothing(make_cluster, monkeypatch):
    from shardps.server.datapath.dataconn import Conn

    kinds: list[int] = []
    frame = Conn._frame
    monkeypatch.setattr(Conn, "_frame", lambda self, magic, kind, *a: kinds.append(kind) or frame(self, magic, kind,
                                                                                                   *a))
    cluster = make_cluster(3)
    with shardps.connect(cluster.addresses, shm=False, part_bytes=1024) as client:
        w = torch.randn(3000)
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        kinds.clear()
        for step in range(2):
            pull = client.pull_async(later=True)
            client.push({"w": torch.ones(3000)}, step=step, window=2, then=pull)
            w = w - 1
            assert torch.equal(pull.result()["w"], w)
        # no pull frame: each shard's pull came with its push (a keepalive ping, on a stalled machine, aside)
        assert [k for k in kinds if k != wire.PING] == [wire.PUSH_PULL] * 6
        # A push every shard refuses (a step that skips one): its carried pulls are not made, nothing is
        # pulled, and the next good step pulls as before.
        pull = client.pull_async(later=True)
        with pytest.raises(shardps.ShardError, match="steps go up by one"):
            client.push({"w": torch.ones(3000)}, step=5, window=2, then=pull)
        with pytest.raises(RuntimeError, match="the step's push failed"):
            pull.result()
        pull = client.pull_async(later=True)
        client.push({"w": torch.ones(3000)}, step=2, window=2, then=pull)
        assert torch.equal(pull.result()["w"], w - 1)


@pytest.mark.parametrize("order", ["not-made-first", "push-first"])
def test_a_carried_pull_not_made_is_pulled_once_its_push_is_taken_in_whichever_is_heard_first(make_cluster, order):
    from shardps.worker.datapath.dataconn import NotMade

    cluster = make_cluster(1)
    with shardps.connect(cluster.addresses, shm=False) as client:
        w = torch.randn(100)
        client.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        pull = client.pull_async(later=True)
        carried = pull.carry(0, client.paths[0])
        assert carried is not None and pull.carry(0, client.paths[0]) is None  # once
        not_made = NotMade(grpc.StatusCode.ABORTED, "not made: its push was refused")
        if order == "not-made-first":  # the refusal's NOT_MADE read before the retried push answered
            carried[2](None, not_made)
            pull.begin(0, 0)
        else:  # the retried push answered (through another path) before the NOT_MADE was read
            pull.begin(0, 0)
            carried[2](None, not_made)
        assert torch.equal(pull.result()["w"], w)
        pull = client.pull_async(later=True)  # a push that failed for good: the pull ends with it
        pull.carry(0, client.paths[0])[2](None, not_made)
        pull.abandon()
        with pytest.raises(RuntimeError, match="the step's push failed"):
            pull.result()


@pytest.mark.fault
def test_a_shard_with_shared_memory_calls_on_the_connection_parks_its_pull_and_keeps_its_segments_when_lost(
        make_cluster):
    """On this machine (shm): the shard's Push and Pull are frames with no bytes after them (``ShmConnPath``); a
    Pull that must wait parks without a thread and gets the weights written into its pull segment; the
    connection lost, the next calls wait for it to be made again and go on it with the same segments; the
    weights exact throughout."""
    from shardps.worker.datapath.dataconn import ShmConnPath

    cluster = make_cluster(1)
    store = cluster.stores[0]
    a = shardps.connect(cluster.addresses, worker_id=0, num_workers=2, timeout=20.0)
    b = shardps.connect(cluster.addresses, worker_id=1, num_workers=2, timeout=20.0)
    try:
        w = torch.randn(300)
        for c in (a, b):
            c.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert [type(p) for p in a.paths] == [ShmConnPath]
        link = a.paths[0].link
        a.push({"w": torch.ones(300)}, step=0)
        pull = _parked_pull(a, store)  # the round waits for worker 1
        b.push({"w": 3 * torch.ones(300)}, step=0)  # the round's last push answers the parked Pull
        assert torch.equal(pull.result()["w"], w - 2) and len(store.path.parked) == 0

        conn = a.paths[0].conn
        conn.sock.shutdown(socket.SHUT_RD)  # the link drops under the reader; the server process stays
        conn._thread.join(10)
        assert not a.paths.usable(0) or a.paths[0].conn is not conn  # (or made again already)
        for k, c in enumerate((a, b)):
            c.push({"w": torch.ones(300) * (2 * k + 1)}, step=1)  # bsp: the mean of the two
        assert torch.equal(a.pull(min_versions=[2])["w"], w - 2 - 2)
        assert type(a.paths[0]) is ShmConnPath and a.paths[0].link is link and a.paths[0].conn is not conn
        for c in (a, b):
            c.push({"w": torch.ones(300)}, step=2)
        assert torch.equal(a.pull(min_versions=[3])["w"], w - 2 - 2 - 1)
        assert torch.equal(b.pull(min_versions=[3])["w"], w - 2 - 2 - 1)
    finally:
        a.close()
        b.close()


def test_two_pushes_framed_on_one_path_at_once_each_carry_their_own_bytes(make_cluster, monkeypatch):
    """A whole push's extents are its own (``_Framed``): they used to be the path's, reset as a push's
    messages were made and taken as it was sent, so a second push framed on the same path before the
    first was sent (a retry beside a push the window started) took the first one's bytes, and the other
    went with none (INVALID_ARGUMENT: "expected its bytes ... received none")."""
    from shardps.worker.datapath.pushframes import PushFramer

    cluster = make_cluster(1)
    with shardps.connect(cluster.addresses, shm=False, part_bytes=32) as c:
        c.register({"a": torch.zeros(8), "b": torch.zeros(12)}, shardps.optim.SGD(lr=1.0), sync="asp")
        [path] = c.paths
        assert isinstance(path, ConnPath)
        flats = {"a": torch.ones(8), "b": torch.full((12,), 2.0)}

        def framed(step):
            return path.push_messages(
                lambda seg: PushFramer(worker_id=0, step=step, base_version=0, loss_scale=0.0, epoch=c.epoch,
                                       sync=c.sync_said, shm=seg), None, flats, set(), c)

        made: list = []
        joined = wire.joined

        def joined_then_another(messages):  # the first push's messages are made, its frame not yet sent:
            if not made:  # the second is framed on the same path at this exact point
                made.append(framed(1))
            return joined(messages)

        monkeypatch.setattr(wire, "joined", joined_then_another)
        assert path.push(framed(0), 10.0).applied and len(made) == 1
        assert path.push(made[0], 10.0).applied
        got = c.pull()
    assert torch.equal(got["a"], torch.full((8,), -2.0)) and torch.equal(got["b"], torch.full((12,), -4.0))


def test_a_segment_closed_under_a_call_is_answered_unavailable_not_internal():
    """Found in a fail-over test: a Pull writing into a worker's segment that closed meanwhile (the worker
    registered again) was answered INTERNAL and logged as a failure of the server; the worker asks again."""
    from shardps.protos.shm import SegmentClosed
    from shardps.server.datapath.dataconn import error_answer

    status, text = error_answer(SegmentClosed("shared-memory segment shardps-1-w1-s0-pull-x was closed"))
    assert status == grpc.StatusCode.UNAVAILABLE.value[0]
    assert text.decode() == "shared-memory segment shardps-1-w1-s0-pull-x was closed while the call used it: ask again"


@pytest.mark.parametrize("soon", [False, True], ids=["call", "frame-that-waits-for-nothing"])
def test_a_pull_done_holds_no_reference_to_its_destinations(make_cluster, soon):
    """A call answered early stays in its connection's deadlines until its deadline: it must not keep the
    pull, and so the tensors it read into, alive (a streamed worker releases its weights after registering;
    held, the whole model stayed in its memory)."""
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses, shm=False, part_bytes=1024) as client:
        client.register({"w": torch.randn(40, 25)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        out = torch.empty(40, 25)
        if soon:
            client.pull_async(["w"], out={"w": out}).result()
        else:
            client.pull(out={"w": out})
        gone = weakref.ref(out)
        del out
        gc.collect()
        assert gone() is None
