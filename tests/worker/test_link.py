"""GroupLink over a real gloo group (ranks in threads of this process): headers, shapes that change, order
checks, deadlines, a neighbour that goes away, and the group kept apart from others by its name."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardps.worker.groups import GroupSpec, open_group
from shardps.worker.pipeline.link import MAX_DIMS, PAYLOAD_MIN, GroupLink, LinkError, decode_header, encode_header
from shardps.worker.pipeline.schedule import Kind

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


def links(n: int, name: str = "pp/test", store: Any = None) -> list[GroupLink]:
    store = store if store is not None else torch.distributed.HashStore()  # type: ignore[attr-defined]
    return in_threads(n, lambda r: GroupLink(open_group(store, GroupSpec(name, r, n, timeout=30), "127.0.0.1"), r, n))


VALUES = [torch.randn(2, 3), torch.arange(5), torch.ones(1, 1, 4, dtype=torch.bfloat16), None,
          torch.tensor(True), torch.randn(3, 2).t(), torch.zeros(0, 7)]  # a transposed (not contiguous) one, empty


def test_values_of_any_shape_and_dtype_arrive_in_order():
    a, b = links(2)
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


def test_an_unexpected_value_says_what_came():
    a, b = links(2)
    a.start(3, 30)
    b.start(3, 30)
    a.send(F, 0, 1, torch.ones(2))
    with pytest.raises(LinkError, match="stage 1 expected the forward output of micro-batch 0 of step 3 from stage 0, "
                                        "got the forward output of micro-batch 1 of step 3") as e:
        b.recv(F, 0, 0)
    assert e.value.reason == "mismatch"


def test_a_wait_ends_at_the_steps_deadline_and_says_for_what():
    a, b = links(2)
    b.start(0, 0.3)
    with pytest.raises(LinkError, match=r"stage 1 waited 0.3s \(the step's deadline\) for the forward output of "
                                        r"micro-batch 0 from stage 0") as e:
        b.recv(F, 0, 0)
    assert (e.value.reason, e.value.peer, e.value.kind, e.value.microbatch) == ("timeout", 0, F, 0)


def test_a_neighbour_that_closes_is_noticed_at_once_with_what_it_took():
    """Closing drops the group: the peer's wait ends (the step's deadline, 600 s, would say "waited"), and
    it learns which of its values the closed stage took last (B0, not B1)."""
    a, b = links(2)
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
    with pytest.raises(RuntimeError, match="the pipeline's group was closed"):
        a.send(F, 0, 2, torch.ones(1))


def test_sent_values_are_freed_once_the_neighbour_has_taken_them():
    """With the step's orders, a value the neighbour took before the task whose value it sends back is
    known taken: the sender stops holding it before the step ends (1F1B keeps its memory bound)."""
    from shardps.worker.pipeline.plan import plan_step

    plan = plan_step("1f1b", [1, 1, 1], 2, "sum")
    a, b = links(2)
    a.start(0, 30, plan.orders)
    b.start(0, 30, plan.orders)
    a.send(F, 0, 0, torch.ones(2))
    b.recv(F, 0, 0)
    b.send(B, 1, 0, torch.ones(2))
    a.recv(B, 1, 0)  # stage 1's B0 comes after its F0: our F0 was taken
    assert a._sends == [] and a._taken == {1: (F, 0)}
    b.flush()


def test_groups_of_other_names_do_not_mix():
    """A pipeline's group and another (a stage's tensor-parallel group, say) on one store, the same ranks:
    each hears only its own."""
    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    pp, tp = links(2, "pp/r0/g1", store), links(2, "tp/s0/g1", store)
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
    (one,) = links(1)
    with pytest.raises(ValueError, match="stage 0 has no neighbour to send the input gradient of micro-batch 0 to"):
        one.send(B, 0, 0, torch.ones(1))
    with pytest.raises(ValueError, match="stage 0 receives from its neighbours only, not from stage 2"):
        one.recv(F, 2, 0)
    with pytest.raises(ValueError, match="stage 0 cannot send as stage 1"):
        one.send(F, 1, 0, torch.ones(1))


def test_values_larger_than_the_receive_posted_ahead_come_after_it_and_it_grows():
    """On CPU the receives of the next value are posted ahead, the payload's as large as the largest so far
    (at least PAYLOAD_MIN): a larger value follows a filler into a receive of its own size; both ends then
    post and send for the new size, smaller values arrive as copies (not views of a much larger buffer)."""
    from shardps.worker.pipeline.plan import plan_step

    big, small = torch.randn(PAYLOAD_MIN // 4 + 5), torch.arange(3.0)  # float32: just over, far under
    plan = plan_step("gpipe", [1] * 4, 2, "sum")
    a, b = links(2)
    for step in (0, 1):
        a.start(step, 30, plan.orders)
        b.start(step, 30, plan.orders)
        sent = [big, small, big * 2, None] if step == 0 else [small, big * 3, big, small]
        for mb, v in enumerate(sent):
            a.send(F, 0, mb, v)
        for mb, v in enumerate(sent):
            got = b.recv(F, 0, mb)
            assert (got is None) if v is None else torch.equal(got, v), (step, mb)
        assert a._cap_out == {1: big.numel() * 4} and b._cap_in == {0: big.numel() * 4}
        for mb in reversed(range(4)):
            b.send(B, 1, mb, torch.full((2,), float(mb)))
        for mb in reversed(range(4)):
            assert torch.equal(a.recv(B, 1, mb), torch.full((2,), float(mb)))
        a.flush()
        b.flush()
    got = b._post(0)  # the next value's receives: the buffer has the grown size
    assert got.buffer is not None and got.buffer.numel() == big.numel() * 4


def test_a_value_counts_as_taken_when_the_neighbour_took_it_not_when_it_arrived():
    """Stage 1 posts the receives of F1 as it takes F0, so F1 arrives there at once; it is counted taken
    only when stage 1 says so: after stage 1 closes, stage 0 learns that it took F0, not F1."""
    from shardps.worker.pipeline.plan import plan_step

    plan = plan_step("gpipe", [1, 1], 2, "sum")
    a, b = links(2)
    a.start(0, 600, plan.orders)
    b.start(0, 600, plan.orders)
    a.send(F, 0, 0, torch.ones(2))
    a.send(F, 0, 1, torch.ones(2))
    assert b.recv(F, 0, 0) is not None
    b._early[0].work.wait(datetime.timedelta(seconds=30))  # F1's payload is in the buffer posted ahead
    b.close()
    with pytest.raises(LinkError, match="stage 0 lost stage 1 while waiting for the input gradient of "
                                        "micro-batch 1") as e:
        a.recv(B, 1, 1)
    assert (e.value.reason, e.value.taken) == ("lost", (F, 0))
