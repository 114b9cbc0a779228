import warnings

import pytest
import torch

from shardps.protos import codec
from shardps.protos.shardps.v1 import ps_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 1023, 100_003])
def test_encode_decode_round_trip(dtype, n):
    x = torch.randn(n).to(dtype)
    wire = codec.to_wire_dtype(dtype)
    pieces = list(codec.encode_range(x, 0, n, chunk_bytes=4096))
    assert all(len(p) <= 4096 for _, p in pieces)
    out = torch.empty(n, dtype=dtype)
    for off, payload in pieces:
        v = codec.decode(payload, wire)
        out[off : off + v.numel()] = v
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       x.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_payload_is_little_endian_raw_bytes():
    payload = next(codec.encode_range(torch.tensor([1.0], dtype=torch.float32), 0, 1))[1]
    assert payload == b"\x00\x00\x80\x3f"


def test_sub_range_offsets():
    x = torch.arange(10, dtype=torch.float32)
    pieces = list(codec.encode_range(x, 3, 9, chunk_bytes=1024))
    assert pieces[0][0] == 3
    assert codec.decode(pieces[0][1], ps_pb2.FLOAT32).tolist() == [3, 4, 5, 6, 7, 8]


def test_bad_payloads_and_dtypes():
    with pytest.raises(ValueError, match="not a whole number of float32"):
        codec.decode(b"\x00" * 5, ps_pb2.FLOAT32)
    with pytest.raises(ValueError, match="unsupported wire dtype 9"):
        codec.decode(b"", 9)
    with pytest.raises(ValueError, match="unsupported dtype torch.int64"):
        codec.to_wire_dtype(torch.int64)
    with pytest.raises(ValueError, match="chunk_bytes"):
        codec.check_chunk_bytes(64 << 20)


ALL_FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(params=["one thread", "torch's pool"])
def sums(request, monkeypatch):
    """Every all_finite test on both sums: numpy's in the calling thread (CPU fp32/fp64 up to
    ONE_THREAD_SUM_BYTES) and torch's (larger ones, other dtypes)."""
    if request.param == "torch's pool":
        monkeypatch.setattr(codec, "ONE_THREAD_SUM_BYTES", -1)
    return request.param


@pytest.mark.parametrize("dtype", ALL_FLOATS)
def test_all_finite(dtype, sums):
    x = torch.randn(1000).to(dtype)
    assert codec.all_finite(x) and codec.all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[517] = bad
        assert not codec.all_finite(y), bad


@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 255, 4097, 262_144])
def test_all_finite_finds_one_bad_value_anywhere(dtype, n, sums):
    """The sum-first check: one inf, -inf or nan in the first, middle or last element (vector tails too)."""
    x = torch.randn(n).to(dtype)
    assert codec.all_finite(x)
    for at in sorted({0, n // 2, n - 1}):
        for bad in (float("inf"), float("-inf"), float("nan")):
            y = x.clone()
            y[at] = bad
            assert not codec.all_finite(y), (at, bad)
            assert not codec.all_finite(y[at:])  # a view starting at the bad value


@pytest.mark.parametrize("dtype", ALL_FLOATS)
def test_all_finite_inf_and_minus_inf_together(dtype, sums):
    x = torch.zeros(100, dtype=dtype)
    x[3], x[70] = float("inf"), float("-inf")  # their sum is nan, not finite either
    assert not codec.all_finite(x)


@pytest.mark.parametrize("dtype", ALL_FLOATS)
def test_all_finite_huge_finite_values_are_finite(dtype, sums):
    """Finite values whose sum overflows to inf (or to -inf) are not flagged."""
    big = torch.finfo(dtype).max
    for sign in (1.0, -1.0):
        x = torch.full((1000,), sign * big, dtype=dtype)
        assert torch.isinf(x.sum()) and codec.all_finite(x)
        x[500] = float("nan")
        assert not codec.all_finite(x)
    # float16: ordinary values past 65504 in total
    y = torch.full((100_000,), 1000.0, dtype=torch.float16).to(dtype)
    assert codec.all_finite(y)


def test_all_finite_non_contiguous(sums):
    x = torch.randn(64, 64).t()
    assert codec.all_finite(x)
    x[5, 60] = float("nan")
    assert not codec.all_finite(x)


def test_all_finite_in_one_thread_warns_of_nothing_and_takes_a_tensor_that_requires_grad():
    """numpy's sum of an inf, a nan or an overflow is the answer, not a RuntimeWarning; a tensor that requires
    grad is read through a detached view."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (torch.float32, torch.float64):
            x = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)
            assert codec.all_finite(x)  # the sum overflows: confirmed finite by min/max
            x[3], x[9] = float("inf"), float("-inf")
            assert not codec.all_finite(x)
    w = torch.randn(32, requires_grad=True)
    assert codec.all_finite(w)
    assert not codec.all_finite(w.detach() / 0.0)


def test_all_finite_sums_a_large_tensor_in_torchs_pool(monkeypatch):
    """Past ONE_THREAD_SUM_BYTES the sum is torch's (its wall time counts more than its pool's spinning)."""
    called = []
    monkeypatch.setattr(codec, "ONE_THREAD_SUM_BYTES", 4 * 1000 - 1)
    real = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self, *a, **k: called.append(self.numel()) or real(self, *a, **k))
    assert codec.all_finite(torch.ones(999)) and called == [999]
    assert codec.all_finite(torch.ones(1000)) and called == [999]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_a_tensors_memory_is_its_own_bytes_writable_and_its_storage_stays_resizable(dtype):
    """What a pull is read into on a data connection: the parameter's own bytes, its storage left resizable (a
    streamed worker frees it with resize_(0) and allocates it again; Tensor.numpy() would forbid that)."""
    t = torch.arange(12).to(dtype)
    view = codec.tensor_memory(t[4:10])
    assert view.nbytes == 6 * t.element_size() and not view.readonly
    assert bytes(view) == t[4:10].contiguous().view(torch.uint8).numpy().tobytes()
    src = torch.full((6,), 7).to(dtype)
    view[:] = codec.tensor_memory(src)
    assert torch.equal(t[4:10], src) and torch.equal(t[:4], torch.arange(4).to(dtype))
    u = torch.ones(5, dtype=dtype)
    assert codec.tensor_memory(u).nbytes == 5 * u.element_size()  # a view made and gone
    u.untyped_storage().resize_(0)  # resizable, as before
    u.untyped_storage().resize_(5 * u.element_size())
    assert codec.tensor_memory(torch.empty(0)).nbytes == 0
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        codec.tensor_memory(torch.arange(12.0).view(3, 4).t())
