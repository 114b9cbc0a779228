"""Pushed gradients from the wire to the step: kept in their chunks (asp), or staged and checked in cache.

``decode_push`` with ``keep_chunks`` hands fp32 parts on as ``Chunked`` (views of
the received messages, never copied); the store steps them slice by slice
when the optimizer takes slices, bit for bit as from a staged copy, and copies
them first everywhere else. bf16/fp16 chunks are cast into fp32 staging and
checked there. Every test builds its messages with the worker's own framing
and parses them with the server's deserializer, as a Push arrives.
"""

from __future__ import annotations

import pytest
import torch

from shardps import optim
from shardps.protos import codec, framing
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.wire import decode_push
from shardps.server.optim.adam import AdamImpl
from shardps.server.optim.base import PartInfo
from shardps.server.optim.sgd import SGDImpl
from shardps.server.store import ShardStore, TensorSpec
from shardps.server.sync import SLICE_ALIGN, Chunked

PARTS = ((0, 3000), (3000, 5000))  # two parts of one 5000-element tensor
SHAPE = (50, 100)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _spec(opt=None, push=torch.float32, parts=PARTS) -> TensorSpec:
    return TensorSpec("w", SHAPE, codec.to_wire_dtype(torch.float32), opt or optim.Adam(lr=1e-2), parts,
                      grad_dtype=codec.to_wire_dtype(push))


def _messages(grad: torch.Tensor, spec: TensorSpec, chunk_bytes: int = 4096, step: int = 0, base: int = 0,
              loss_scale: float = 0.0, reverse: bool = False) -> list:
    """The Push as the server's deserializer hands it over (framing.parse_push_request)."""
    prefix, suffix = framing.header(ps_pb2.PushRequest, worker_id=0, step=step, base_version=base,
                                    loss_scale=loss_scale)
    flat = grad.to(codec.to_torch_dtype(spec.push_dtype)).contiguous().view(-1)
    msgs = [m for a, b in spec.parts
            for _, _, m in framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, "w", spec.push_dtype,
                                                  SHAPE, flat, a, b, chunk_bytes)]
    return [framing.parse_push_request(m) for m in (msgs[::-1] if reverse else msgs)]


def _decode(grad, spec, keep=True, **kw):
    return decode_push(iter(_messages(grad, spec, **kw)), lambda name: spec, keep_chunks=lambda scale: keep)


def test_fp32_chunks_are_kept_as_received_not_copied():
    spec = _spec()
    grad = torch.randn(SHAPE)
    msgs = _messages(grad, spec)
    g = decode_push(iter(msgs), lambda name: spec, keep_chunks=lambda scale: True)
    assert set(g.grads) == {("w", 0), ("w", 3000)} and not g.found_inf
    payloads = {bytes(m.chunk.data) for m in msgs}
    for (_, start), part in g.grads.items():
        assert isinstance(part, Chunked) and part.numel() == dict(PARTS)[start] - start
        for _, piece in part.pieces:  # views of the messages' own memory
            assert piece.dtype == torch.float32 and bytes(piece.numpy().tobytes()) in payloads
        assert torch.equal(part.copy_to(torch.empty(part.numel())), grad.view(-1)[start : dict(PARTS)[start]])


def test_chunks_arriving_out_of_order_are_put_in_order():
    spec = _spec()
    grad = torch.randn(SHAPE)
    g = _decode(grad, spec, reverse=True)
    for (_, start), part in g.grads.items():
        assert isinstance(part, Chunked)
        assert [a for a, _ in part.pieces] == sorted(a for a, _ in part.pieces)
        assert torch.equal(part.copy_to(torch.empty(part.numel())), grad.view(-1)[start : dict(PARTS)[start]])


@pytest.mark.parametrize("push", ["bfloat16", "float16"])
def test_half_chunks_are_cast_into_fp32_staging(push):
    spec = _spec(push=DTYPES[push])
    grad = torch.randn(SHAPE)
    g = _decode(grad, spec, keep=True)  # kept only when no cast is needed
    expected = grad.to(DTYPES[push]).float().view(-1)
    for (_, start), part in g.grads.items():
        assert isinstance(part, torch.Tensor) and part.dtype == torch.float32
        assert torch.equal(part, expected[start : dict(PARTS)[start]])


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("push", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("at", [0, 2999, 3000, 3500, 4999])  # first, last of part 0; first, middle, last of part 1
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_one_non_finite_value_anywhere_is_found(keep, push, at, bad):
    spec = _spec(push=DTYPES[push])
    grad = torch.randn(SHAPE)
    assert not _decode(grad, spec, keep=keep).found_inf
    grad.view(-1)[at] = bad
    assert _decode(grad, spec, keep=keep).found_inf


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("push", ["float32", "bfloat16", "float16"])
def test_huge_finite_values_are_not_flagged(keep, push):
    """Values whose sum overflows (in the push dtype or in fp32) are finite: no inf/nan found."""
    spec = _spec(push=DTYPES[push])
    for sign in (1.0, -1.0):
        grad = torch.full(SHAPE, sign * torch.finfo(DTYPES[push]).max, dtype=torch.float32)
        assert not _decode(grad, spec, keep=keep).found_inf
    if push == "float16":  # ordinary float16 values past 65504 in total
        assert not _decode(torch.full(SHAPE, 1000.0), spec, keep=keep).found_inf


def test_keep_chunks_is_asked_with_the_pushs_loss_scale():
    spec = _spec()
    asked = []
    msgs = _messages(torch.randn(SHAPE), spec, loss_scale=1024.0)
    g = decode_push(iter(msgs), lambda name: spec, keep_chunks=lambda scale: asked.append(scale) or False)
    assert asked == [1024.0] and all(isinstance(t, torch.Tensor) for t in g.grads.values())


def test_chunked_copy_add_and_sliceable():
    data = torch.randn(300)
    pieces = [(0, data[:128]), (128, data[128:256]), (256, data[256:])]
    c = Chunked(300, pieces)
    assert c.numel() == 300 and c.sliceable and torch.equal(c.copy_to(torch.empty(300)), data)
    acc = torch.ones(300)
    c.add_to(acc)
    assert torch.equal(acc, 1 + data)
    assert not Chunked(300, [(0, data[:100]), (100, data[100:])]).sliceable  # 100 is not whole lanes
    assert Chunked(100, [(0, data[:100])]).sliceable  # the last piece may be any length


def test_adam_step_many_advances_a_shared_step_count_once():
    impl = AdamImpl(optim.Adam(lr=0.1))
    info = PartInfo((8,), 0, 8)
    w = torch.randn(8)
    state = impl.init_state(w, info)
    g = torch.randn(8)
    states = impl.split_state(state, [4, 4])
    assert states[0]["step"] is state["step"] and states[1]["exp_avg"].data_ptr() == state["exp_avg"][4:].data_ptr()
    items = [(w[a:b], g[a:b], st, info) for (a, b), st in zip(((0, 4), (4, 8)), states)]
    assert impl.takes_slices()
    impl.step_many(items)
    assert state["step"].item() == 1



@pytest.mark.parametrize("spec", [optim.SGD(lr=0.1, momentum=0.9, dampening=0.5),
                                  optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)])
def test_sgd_step_many_over_slices_is_the_step_of_the_part(spec):
    """Slices share the part's step count: the first step (which starts the momentum buffer) is the first
    for every slice, and the count advances once."""
    impl = SGDImpl(spec)
    info = PartInfo((8,), 0, 8)
    torch.manual_seed(4)
    w = torch.randn(8)
    whole_w, whole_state = w.clone(), impl.init_state(w, info)
    state = impl.init_state(w, info)
    assert impl.takes_slices()
    for _ in range(3):
        g = torch.randn(8)
        impl.step(whole_w, g, whole_state, info)
        states = impl.split_state(state, [4, 4])
        impl.step_many([(w[a:b], g[a:b], st, info) for (a, b), st in zip(((0, 4), (4, 8)), states)])
    assert state["step"].item() == 3
    assert torch.equal(w, whole_w) and torch.equal(state["momentum_buffer"], whole_state["momentum_buffer"])

OPTS = {
    "adam": optim.Adam(lr=1e-2),
    "adamw-amsgrad": optim.AdamW(lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam-wd": optim.Adam(lr=1e-2, weight_decay=0.01),
    "sgd": optim.SGD(lr=0.1),
    "sgd-momentum": optim.SGD(lr=0.1, momentum=0.9),
    "sgd-nesterov-wd": optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, dampening=0.0),
    "adafactor": optim.Adafactor(),  # no slices (row and column statistics): stepped from a copy
}
SLICED = ("adam", "sgd")  # the optimizers whose step_many takes slices of a part


def _store(spec: TensorSpec, sync: str = "asp", workers: int = 1, remedy: str | None = None) -> ShardStore:
    st = ShardStore(0, 1)
    st.path.configure(workers, sync, remedy=remedy)
    torch.manual_seed(1)
    w0 = torch.randn(SHAPE).view(-1)
    st.path.register_tensors([spec], {("w", a): w0[a:b].clone() for a, b in spec.parts})
    for i in range(workers):
        st.leases.register(i)
    return st


def _state(st: ShardStore) -> dict:
    return {(n, s, k): t for n, s, _, k, t in st.reader.export_state(["w"])[1]}


def _same(a: ShardStore, b: ShardStore) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert a.job.version == b.job.version


def _push(st, grad, spec, step, chunked, worker=0, **kw):
    g = decode_push(iter(_messages(grad, spec, step=step, base=st.job.version, **kw)), st.table.spec,
                    st.applier.pool.take,
                    keep_chunks=(lambda scale: True) if chunked else None)
    return st.path.submit(worker, g.step, g.base_version, g.grads, g.nbytes, found_inf=g.found_inf,
                     loss_scale=g.loss_scale, checked=True)


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("chunk_bytes", [4096, 1000])  # 1024 and 250 elements: slices, and not whole lanes
def test_a_step_from_chunks_is_the_step_from_a_staged_copy(opt, chunk_bytes):
    spec = _spec(OPTS[opt])
    chunked, staged = _store(spec), _store(spec)
    copies = []
    take = chunked.applier.pool.take
    chunked.applier.pool.take = lambda key, n: copies.append(key) or take(key, n)
    torch.manual_seed(2)
    for step in range(3):
        grad = torch.randn(SHAPE)
        assert _push(chunked, grad, spec, step, True, chunk_bytes=chunk_bytes).applied
        assert _push(staged, grad, spec, step, False, chunk_bytes=chunk_bytes).applied
    _same(chunked, staged)
    from_slices = opt.startswith(SLICED) and chunk_bytes % (4 * SLICE_ALIGN) == 0
    assert copies == ([] if from_slices else [("w", 0), ("w", 3000)] * 3)  # copied only when it must be


def test_a_step_from_chunks_matches_torch_adam():
    spec = _spec(optim.Adam(lr=1e-2), parts=((0, 5000),))
    st = _store(spec)
    w = st.reader.weights("w")[0].view(SHAPE).clone().requires_grad_(True)
    # Against torch's fused kernel, the one the server steps with: its single-tensor loop rounds differently,
    # by up to 3e-6 here after 3 steps, depending on what ran before in the process.
    ref = torch.optim.Adam([w], lr=1e-2, fused=True)
    torch.manual_seed(3)
    for step in range(3):
        grad = torch.randn(SHAPE)
        _push(st, grad, spec, step, True, chunk_bytes=4096)
        w.grad = grad
        ref.step()
    assert torch.allclose(st.reader.weights("w")[0].view(SHAPE), w.detach(), rtol=0, atol=1e-6)


def test_a_non_finite_chunk_skips_the_step_and_changes_no_weight():
    spec = _spec()
    st = _store(spec)
    _push(st, torch.randn(SHAPE), spec, 0, True)
    before = _state(st)
    grad = torch.randn(SHAPE)
    grad.view(-1)[4999] = float("nan")
    res = _push(st, grad, spec, 1, True)
    assert not res.applied and st.applier.skipped_steps_total == 1 and st.job.version == 2  # the version advances
    after = _state(st)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_refused_push_in_chunks_changes_nothing():
    spec = _spec()
    st = _store(spec)
    _push(st, torch.randn(SHAPE), spec, 0, True)
    before, version = _state(st), st.job.version
    with pytest.raises(Exception, match="steps go up by one"):
        _push(st, torch.randn(SHAPE), spec, 5, True)
    after = _state(st)
    assert st.job.version == version and all(torch.equal(before[k], after[k]) for k in before)


def test_takes_chunked_only_where_the_step_reads_them_as_they_are():
    spec = _spec()
    assert _store(spec).path.takes_chunked(0.0)
    assert not _store(spec).path.takes_chunked(128.0)  # to unscale: copied as the chunks arrive
    assert not _store(spec, "bsp", workers=2).path.takes_chunked(0.0)  # summed: copied as the chunks arrive
    assert not ShardStore(0, 1).path.takes_chunked(0.0)  # no job yet


@pytest.mark.parametrize("sync,workers,remedy", [("bsp", 2, None), ("every:2", 2, None), ("asp", 2, "dc-asgd:0.5"),
                                                 ("asp", 1, "lr-scale")])
def test_chunks_handed_where_they_must_be_copied_give_the_same_result(sync, workers, remedy):
    """submit takes Chunked whatever the mode: copied for a barrier's sum, for a compensation."""
    spec = _spec()
    chunked, staged = _store(spec, sync, workers, remedy), _store(spec, sync, workers, remedy)
    for st in (chunked, staged):
        if remedy and remedy.startswith("dc-asgd"):
            st.reader.read(["w"], None, worker_id=1)
    torch.manual_seed(4)
    for step in range(2):
        for worker in range(workers):
            grad = torch.randn(SHAPE)
            base = chunked.job.version
            for st, kept in ((chunked, True), (staged, False)):
                g = decode_push(iter(_messages(grad, spec, step=step, base=base)), st.table.spec, st.applier.pool.take,
                                keep_chunks=(lambda scale: True) if kept else None)
                assert any(isinstance(t, Chunked) for t in g.grads.values()) == kept
                st.path.submit(worker, g.step, g.base_version, g.grads, found_inf=g.found_inf, checked=True)
    _same(chunked, staged)


def test_loss_scaled_chunks_are_unscaled_like_staged_ones():
    spec = _spec()
    st_a, st_b = _store(spec), _store(spec)
    grad = torch.randn(SHAPE) * 1024
    for st, kept in ((st_a, True), (st_b, False)):
        g = decode_push(iter(_messages(grad, spec, loss_scale=1024.0)), st.table.spec, st.applier.pool.take,
                        keep_chunks=(lambda scale: True) if kept else None)
        st.path.submit(0, g.step, g.base_version, g.grads, found_inf=g.found_inf, loss_scale=g.loss_scale, checked=True)
    _same(st_a, st_b)


def test_slice_align_divides_the_default_chunk():
    assert (codec.DEFAULT_CHUNK_BYTES // 4) % SLICE_ALIGN == 0
    assert (codec.DEFAULT_CHUNK_BYTES // 2) % SLICE_ALIGN == 0


@pytest.mark.parametrize("push", ["float32", "float16"])
def test_a_scaled_push_is_checked_once_as_it_is_unscaled(push):
    """With a loss scale the chunks are not checked on arrival: submit checks while unscaling, one pass."""
    spec = _spec(push=DTYPES[push])
    st = _store(spec)
    grad = torch.randn(SHAPE)
    grad.view(-1)[3000] = float("inf")
    g = decode_push(iter(_messages(grad, spec, loss_scale=8.0)), st.table.spec, st.applier.pool.take,
                    keep_chunks=st.path.takes_chunked)
    assert not g.found_inf  # not looked at here
    res = st.path.submit(0, g.step, g.base_version, g.grads, found_inf=g.found_inf, loss_scale=g.loss_scale,
                    checked=True)
    assert not res.applied and st.applier.skipped_steps_total == 1
