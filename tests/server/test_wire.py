"""Decoding requests (server/datapath/wire.py): everything refused before the store is touched."""

from __future__ import annotations

import pytest
import torch

import shardps
from shardps.protos import codec
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.wire import decode_pull, decode_push, decode_register, encode_state
from shardps.server.errors import InvalidArgument, NotFound
from shardps.server.table import TensorSpec

SPEC = TensorSpec("w", (4,), ps_pb2.FLOAT32, shardps.optim.SGD(lr=1.0), ((0, 4),))


def _lookup(name):
    if name != "w":
        raise NotFound(f"no tensor {name!r}")
    return SPEC


def _chunk(values, offset=0, name="w"):
    t = torch.tensor(values, dtype=torch.float32)
    data = next(codec.encode_range(t, 0, t.numel()))[1]
    return ps_pb2.Chunk(name=name, offset=offset, dtype=ps_pb2.FLOAT32, data=data)


def _push(step=0, found_inf=False, **chunk):
    return ps_pb2.PushRequest(worker_id=1, step=step, base_version=3, found_inf=found_inf, loss_scale=0.0,
                              chunk=_chunk(**chunk))


def test_push_assembles_gradients_and_header():
    g = decode_push(iter([_push(values=[1.0, 2.0]), _push(values=[3.0, 4.0], offset=2)]), _lookup)
    assert (g.worker_id, g.step, g.base_version, g.found_inf, g.nbytes) == (1, 0, 3, False, 16)
    assert g.grads[("w", 0)].tolist() == [1.0, 2.0, 3.0, 4.0]


def _ends(msg, last=False):
    msg.ends_with_last, msg.last = True, last
    return msg


def test_the_last_message_of_a_stream_that_ends_with_last_may_raise_found_inf():
    """A streaming worker learns at the end of backward whether its gradient was finite, and says so in its
    last, header-only message: that message alone may raise the flag."""
    last = _ends(ps_pb2.PushRequest(worker_id=1, step=0, base_version=3, found_inf=True), last=True)
    chunks = [_ends(_push(values=[1.0, 2.0])), _ends(_push(values=[3.0, 4.0], offset=2))]
    g = decode_push(iter([*chunks, last]), _lookup)
    assert g.found_inf and g.grads[("w", 0)].tolist() == [1.0, 2.0, 3.0, 4.0]
    last.found_inf = False
    assert not decode_push(iter([*chunks, last]), _lookup).found_inf


# Regression (fuzzer, 2026-12-01, seed 20261201): a stream whose later message said found_inf where the first
# did not was taken as one step, its flag the OR of the messages' (the rule the streaming worker needs, applied
# to every stream): the shard stepped, or skipped, on a gradient whose messages disagreed.
@pytest.mark.parametrize("flags, ends, why", [
    ((False, True), False, "raised, no ends_with_last"),
    ((True, False), False, "lowered, no ends_with_last"),
    ((False, True, False), True, "raised before the last message"),
    ((True, True, False), True, "lowered by the last message"),
])
def test_found_inf_that_disagrees_is_refused(flags, ends, why):
    n = len(flags)
    msgs = [_push(found_inf=f, values=[1.0] * (4 // n if i < n - 1 else 4 - (4 // n) * (n - 1)), offset=(4 // n) * i)
            for i, f in enumerate(flags)]
    if ends:
        msgs = [_ends(m, last=i == n - 1) for i, m in enumerate(msgs)]
    with pytest.raises(InvalidArgument, match=r"Push stream mixes headers: message \d has found_inf"):
        decode_push(iter(msgs), _lookup)


@pytest.mark.parametrize("field, value", [("worker_id", 2), ("step", 1), ("base_version", 4), ("loss_scale", 1024.0),
                                          ("epoch", 1), ("shm", "seg"), ("ends_with_last", True),
                                          ("pull_after", True), ("pull_dtype", ps_pb2.BFLOAT16),
                                          ("pull_min_clock", 3)])
def test_every_header_field_must_agree(field, value):
    second = _push(values=[3.0, 4.0], offset=2)
    setattr(second, field, value)
    with pytest.raises(InvalidArgument) as e:
        decode_push(iter([_push(values=[1.0, 2.0]), second]), _lookup)
    first_value = getattr(_push(values=[1.0]), field)
    assert f"message 2 has {field} {value!r}, the first message {first_value!r}" in str(e.value)


def test_a_register_stream_whose_later_message_disagrees_is_refused():
    spec = SPEC.to_proto()
    first = ps_pb2.RegisterRequest(worker_id=0, num_workers=2, sync="bsp", tensors=[spec], provides_values=True,
                                   chunk=_chunk([5.0, 6.0]))
    rest = ps_pb2.RegisterRequest(chunk=_chunk([7.0, 8.0], offset=2))
    assert decode_register(iter([first, rest])).values is not None
    same = ps_pb2.RegisterRequest(worker_id=0, sync="bsp", chunk=_chunk([7.0, 8.0], offset=2))  # repeats: fine
    assert decode_register(iter([first, same])).values is not None
    other = ps_pb2.RegisterRequest(sync="asp", chunk=_chunk([7.0, 8.0], offset=2))
    with pytest.raises(InvalidArgument, match="Register stream mixes headers: message 2 has sync 'asp', the first "
                                              "message 'bsp'"):
        decode_register(iter([first, other]))


def test_a_stream_that_says_it_ends_with_last_and_does_not_is_refused():
    """gRPC can show a cancelled client stream to the server as ended: without its last message, a stream
    that promised one was cut, and nothing of it may be applied."""
    first = _push(values=[1.0, 2.0])
    first.ends_with_last = True
    second = _push(values=[3.0, 4.0], offset=2)
    second.ends_with_last = True
    with pytest.raises(InvalidArgument, match="ended before its last message"):
        decode_push(iter([first, second]), _lookup)
    end = ps_pb2.PushRequest(worker_id=1, step=0, base_version=3, ends_with_last=True, last=True)
    g = decode_push(iter([first, second, end]), _lookup)
    assert g.grads[("w", 0)].tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(InvalidArgument, match="after its last message"):
        decode_push(iter([first, end, second]), _lookup)


def test_push_with_a_non_finite_chunk_is_found_inf():
    g = decode_push(iter([_push(values=[1.0, float("inf"), 0.0, 0.0])]), _lookup)
    assert g.found_inf


def test_push_refuses_mixed_headers_empty_streams_and_unknown_tensors():
    with pytest.raises(InvalidArgument, match="mixes headers"):
        decode_push(iter([_push(values=[1.0, 2.0]), _push(step=1, values=[3.0, 4.0], offset=2)]), _lookup)
    with pytest.raises(InvalidArgument, match="empty"):
        decode_push(iter([]), _lookup)
    with pytest.raises(NotFound, match="'v'"):
        decode_push(iter([_push(values=[1.0], name="v")]), _lookup)


def test_register_with_and_without_values():
    spec = SPEC.to_proto()
    first = ps_pb2.RegisterRequest(worker_id=0, num_workers=2, sync="bsp", tensors=[spec], provides_values=True,
                                   chunk=_chunk([5.0, 6.0, 7.0, 8.0]))
    j = decode_register(iter([first]))
    assert (j.worker_id, j.num_workers, j.sync, j.scaling) == (0, 2, "bsp", None)
    assert j.values is not None and j.values[("w", 0)].tolist() == [5.0, 6.0, 7.0, 8.0]
    later = ps_pb2.RegisterRequest(worker_id=1, num_workers=2, sync="bsp", tensors=[spec])
    assert decode_register(iter([later])).values is None
    with pytest.raises(InvalidArgument, match="without provides_values"):
        decode_register(iter([later, ps_pb2.RegisterRequest(chunk=_chunk([1.0]))]))
    with pytest.raises(InvalidArgument, match="more than once"):
        decode_register(iter([ps_pb2.RegisterRequest(num_workers=1, tensors=[spec, spec])]))
    with pytest.raises(InvalidArgument, match="'v', which this Register does not declare"):
        decode_register(iter([ps_pb2.RegisterRequest(num_workers=1, tensors=[spec], provides_values=True,
                                                     chunk=_chunk([1.0], name="v"))]))


def test_pull_options_are_checked():
    q = decode_pull(ps_pb2.PullRequest(worker_id=2, names=["w"], min_version=5), codec.DEFAULT_CHUNK_BYTES)
    assert (q.worker_id, q.names, q.wire_dtype, q.chunk_bytes, q.min_version) == (
        2, ["w"], None, codec.DEFAULT_CHUNK_BYTES, 5)
    assert decode_pull(ps_pb2.PullRequest(dtype=ps_pb2.BFLOAT16), 4096).wire_dtype == ps_pb2.BFLOAT16
    with pytest.raises(InvalidArgument, match="chunk_bytes must be in"):
        decode_pull(ps_pb2.PullRequest(chunk_bytes=10), 4096)
    with pytest.raises(InvalidArgument, match="Pull:"):
        decode_pull(ps_pb2.PullRequest(dtype=99), 4096)  # type: ignore[arg-type]


def test_state_chunks_carry_the_shape_once():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    chunks = list(encode_state(7, [("w", 0, 6, "weight", w)], 1024))
    assert [c.shape for c in chunks] == [[2, 3]] and chunks[0].version == 7
    assert codec.decode(chunks[0].chunk.data, chunks[0].chunk.dtype).tolist() == w.reshape(-1).tolist()
