"""The links between pipeline stages, each stage in a thread of this process: ``SocketLink`` over real
connections (TCP and Unix) and ``GroupLink`` over a real gloo group (as on nccl): headers, shapes that
change, order checks, deadlines, a neighbour that goes away, and a pipeline kept apart from others by its
name; then what only the sockets do (values larger than the kernel's buffers, words held back)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardps.worker.groups import GroupSpec, open_group
from shardps.worker.pipeline.link import MAX_DIMS, GroupLink, LinkError, decode_header, encode_header
from shardps.worker.pipeline.linkconnect import open_socket_link
from shardps.worker.pipeline.plan import plan_step
from shardps.worker.pipeline.schedule import Kind
from shardps.worker.pipeline.socketlink import SocketLink

F, B = Kind.FORWARD, Kind.BACKWARD


def in_threads(n: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """``fn(rank)`` in n threads at once; their results, or the first error raised again."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return out


KINDS = ("socket", "group")


def links(n: int, name: str = "pp/test", store: Any = None, kind: str = "socket") -> list[Any]:
    store = store if store is not None else torch.distributed.HashStore()  # type: ignore[attr-defined]
    if kind == "socket":
        return in_threads(n, lambda r: open_socket_link(store, name, r, n, "127.0.0.1", 30))
    return in_threads(n, lambda r: GroupLink(open_group(store, GroupSpec(name, r, n, timeout=30), "127.0.0.1"), r, n))


@pytest.fixture(params=KINDS)
def kind(request: Any) -> str:
    return request.param


VALUES = [torch.randn(2, 3), torch.arange(5), torch.ones(1, 1, 4, dtype=torch.bfloat16), None,
          torch.tensor(True), torch.randn(3, 2).t(), torch.zeros(0, 7)]  # a transposed (not contiguous) one, empty


def test_values_of_any_shape_and_dtype_arrive_in_order(kind):
    a, b = links(2, kind=kind)
    for step in (0, 1):
        a.start(step, 30)
        b.start(step, 30)
        for mb, v in enumerate(VALUES):
            a.send(F, 0, mb, v)
        for mb, v in enumerate(VALUES):
            got = b.recv(F, 0, mb)
            if v is None:
                assert got is None
            else:
                assert got is not None and got.dtype == v.dtype and got.shape == v.shape
                assert torch.equal(got, v)
        b.send(B, 1, 0, torch.full((4,), 2.0))  # and back
        assert torch.equal(a.recv(B, 1, 0), torch.full((4,), 2.0))
        a.flush()
        b.flush()


def test_an_unexpected_value_says_what_came(kind):
    a, b = links(2, kind=kind)
    a.start(3, 30)
    b.start(3, 30)
    a.send(F, 0, 1, torch.ones(2))
    with pytest.raises(LinkError, match="stage 1 expected the forward output of micro-batch 0 of step 3 from stage 0, "
                                        "got the forward output of micro-batch 1 of step 3") as e:
        b.recv(F, 0, 0)
    assert e.value.reason == "mismatch"


def test_a_wait_ends_at_the_steps_deadline_and_says_for_what(kind):
    a, b = links(2, kind=kind)
    b.start(0, 0.3)
    with pytest.raises(LinkError, match=r"stage 1 waited 0.3s \(the step's deadline\) for the forward output of "
                                        r"micro-batch 0 from stage 0") as e:
        b.recv(F, 0, 0)
    assert (e.value.reason, e.value.peer, e.value.kind, e.value.microbatch) == ("timeout", 0, F, 0)


def test_a_neighbour_that_closes_is_noticed_at_once_with_what_it_took(kind):
    """Closing drops the connections: the peer's wait ends (the step's deadline, 600 s, would say "waited"),
    and it learns which of its values the closed stage took last (B0, not B1)."""
    a, b = links(2, kind=kind)
    a.start(0, 600)
    b.start(0, 600)
    b.send(B, 1, 0, torch.ones(3))
    assert a.recv(B, 1, 0) is not None
    b.send(B, 1, 1, torch.ones(3))  # never taken
    a.close()
    with pytest.raises(LinkError, match="stage 1 lost stage 0 while waiting for the forward output of micro-batch 2"
                       ) as e:
        b.recv(F, 0, 2)
    assert (e.value.reason, e.value.peer, e.value.taken) == ("lost", 0, (B, 0))
    with pytest.raises(RuntimeError, match="the pipeline's (group was|connections were) closed"):
        a.send(F, 0, 2, torch.ones(1))


def test_sent_values_are_freed_once_the_neighbour_has_taken_them():
    """GroupLink, with the step's orders: a value the neighbour took before the task whose value it sends
    back is known taken: the sender stops holding it before the step ends (1F1B keeps its memory bound).
    (A SocketLink holds a value only until the kernel took its bytes.)"""
    plan = plan_step("1f1b", [1, 1, 1], 2, "sum")
    a, b = links(2, kind="group")
    a.start(0, 30, plan.orders)
    b.start(0, 30, plan.orders)
    a.send(F, 0, 0, torch.ones(2))
    b.recv(F, 0, 0)
    b.send(B, 1, 0, torch.ones(2))
    a.recv(B, 1, 0)  # stage 1's B0 comes after its F0: our F0 was taken
    assert a._sends == [] and a._taken == {1: (F, 0)}
    b.flush()


def test_groups_of_other_names_do_not_mix(kind):
    """Two pipelines (or a pipeline's group and a stage's tensor-parallel group) on one store, the same
    ranks: each hears only its own."""
    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    pp, tp = links(2, "pp/r0/g1", store, kind), links(2, "tp/s0/g1", store, kind)
    for link in pp + tp:
        link.start(0, 30)
    pp[0].send(F, 0, 0, torch.tensor([1.0]))
    tp[0].send(F, 0, 0, torch.tensor([2.0]))
    assert tp[1].recv(F, 0, 0).item() == 2.0 and pp[1].recv(F, 0, 0).item() == 1.0


def test_bad_input_is_refused_with_the_values():
    with pytest.raises(TypeError, match="a stage hands its neighbour tensors, got list for the forward output of "
                                        "micro-batch 0"):
        encode_header(F, 0, 0, [1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype torch.uint16 cannot be sent between stages"):
        encode_header(F, 0, 0, torch.zeros(1, dtype=torch.uint16))
    with pytest.raises(ValueError, match=f"11 dimensions, at most {MAX_DIMS} can be sent"):
        encode_header(B, 2, 0, torch.zeros([1] * 11))
    with pytest.raises(ValueError, match="not a pipeline header"):
        decode_header(torch.zeros(16, dtype=torch.int64))
    assert decode_header(encode_header(B, 4, 7, torch.zeros(2, 3, dtype=torch.float16))) == \
        (B, 4, 7, torch.float16, (2, 3))
    for kw, msg in [({"rank": 2, "size": 2}, "rank must be in \\[0, size\\), got rank 2 of 2"),
                    ({"backend": "mpi"}, "backend must be one of gloo, nccl, got 'mpi'"),
                    ({"timeout": 0}, "timeout must be > 0 seconds, got 0"), ({"name": ""}, "needs a name")]:
        with pytest.raises(ValueError, match=msg):
            GroupSpec(**{"name": "pp/x", "rank": 0, "size": 2, **kw})  # type: ignore[arg-type]
    for one in links(1) + links(1, kind="group"):
        check_one_stage(one)
    with pytest.raises(ValueError, match="stage 1 connects to its neighbours only, not to stage 3"):
        SocketLink({3: None}, 1, 4)  # type: ignore[dict-item]


def check_one_stage(one: Any) -> None:
    with pytest.raises(ValueError, match="stage 0 has no neighbour to send the input gradient of micro-batch 0 to"):
        one.send(B, 0, 0, torch.ones(1))
    with pytest.raises(ValueError, match="stage 0 receives from its neighbours only, not from stage 2"):
        one.recv(F, 2, 0)
    with pytest.raises(ValueError, match="stage 0 cannot send as stage 1"):
        one.send(F, 1, 0, torch.ones(1))


def test_values_larger_than_the_kernels_buffers_go_both_ways_at_once_without_blocking():
    """1F1B sends both ways before it receives: a value of 48 MB each way (far over a connection's
    buffers) returns from ``send`` at once, the writer thread writes the rest as the neighbour reads, and
    neither side blocks the other. The sent tensor is not copied: its bytes go from its own memory."""
    a, b = links(2)
    big = torch.randn(12 << 20)
    for link in (a, b):
        link.start(0, 60)
    a.send(F, 0, 0, big)
    b.send(B, 1, 0, big * 2)
    assert a._out[1] and 1 in a._busy  # not all in the kernel: the rest is queued, to the writer thread
    got = in_threads(2, lambda r: b.recv(F, 0, 0) if r else a.recv(B, 1, 0))
    assert torch.equal(got[1], big) and torch.equal(got[0], big * 2)
    in_threads(2, lambda r: (a, b)[r].flush())
    assert not a._out[1] and not b._out[0] and not a._busy and not b._busy


def test_a_value_counts_as_taken_when_the_neighbour_took_it_not_when_it_arrived():
    """Stage 1 reads F1 as it takes F0 (both came); it counts as taken only when stage 1 says so. The
    words are held back until stage 1 waits (not on its critical path), and the last value's goes at once:
    after stage 1 closes, stage 0 learns that it took F0, not F1."""
    plan = plan_step("gpipe", [1, 1], 3, "sum")
    a, b = links(2)
    a.start(0, 600, plan.orders)
    b.start(0, 600, plan.orders)
    a.send(F, 0, 0, torch.ones(2))
    a.send(F, 0, 1, torch.ones(2))
    b._wait(lambda: len(b._in[0].values) == 2, 0, F, 1, False)  # both arrive (no word is held back yet)
    assert b.recv(F, 0, 0) is not None and len(b._in[0].values) == 1  # F1 arrived, not taken
    assert b._acks  # the word that it took F0, held back
    b._deadline = time.monotonic() + 0.05
    with pytest.raises(LinkError, match="waited"):
        b._wait(lambda: False, 0, F, 2, False)  # a wait (for what does not come) sends the words first
    assert not b._acks
    b.close()
    with pytest.raises(LinkError, match="stage 0 lost stage 1 while waiting for the input gradient of "
                                        "micro-batch 1") as e:
        a.recv(B, 1, 1)
    assert (e.value.reason, e.value.taken) == ("lost", (F, 0))


def test_the_last_value_from_a_neighbour_is_said_taken_at_once():
    """The word for a neighbour's last value of the step is not held back: the neighbour's ``flush``
    ends as this stage takes it, not when this stage next waits (its push to the servers would wait)."""
    plan = plan_step("gpipe", [1, 1], 2, "sum")
    a, b = links(2)
    a.start(0, 30, plan.orders)
    b.start(0, 30, plan.orders)
    for mb in range(2):
        b.send(B, 1, mb, torch.full((3,), float(mb)))
    for mb in range(2):
        assert torch.equal(a.recv(B, 1, mb), torch.full((3,), float(mb)))
    b.flush()  # a has not waited since: the words came with its last take
    assert not b._unacked[0] and b._taken == {0: (B, 1)}


def test_a_neighbour_on_this_host_is_reached_over_a_unix_socket_and_one_in_another_namespace_over_tcp():
    """The stages of one host skip the TCP/IP stack; a published Unix name that does not answer (a stage
    in another network namespace: the simulated cluster's hosts) falls back to TCP."""
    import socket

    a, b = links(2)
    assert a._socks[1].family == socket.AF_UNIX and b._socks[0].family == socket.AF_UNIX
    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    store.set("pp/far/link/0", "127.0.0.1|1|shardps-link-nobody-listens-here")  # a stale, unreachable name
    listener = socket.create_server(("127.0.0.1", 0))
    store.set("pp/far/link/0", f"127.0.0.1|{listener.getsockname()[1]}|shardps-link-nobody-listens-here")
    from shardps.worker.pipeline.linkconnect import connect

    sock = connect(store.get("pp/far/link/0").decode(), "127.0.0.1", time.monotonic() + 10)
    assert sock.family == socket.AF_INET
    sock.close()
    listener.close()
