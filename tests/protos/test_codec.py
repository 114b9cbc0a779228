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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite(dtype):
    x = torch.randn(1000).to(dtype)
    assert codec.all_finite(x) and codec.all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[517] = bad
        assert not codec.all_finite(y), bad
