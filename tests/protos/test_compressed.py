"""Compressed chunks (protos/compressed.py): framed as protobuf frames them, checked field by field, expanded."""

from __future__ import annotations

import random

import pytest
import torch

from shardps.protos import compressed, framing
from shardps.protos.shardps.v1 import ps_pb2

DTYPES = {ps_pb2.FLOAT32: torch.float32, ps_pb2.FLOAT16: torch.float16, ps_pb2.BFLOAT16: torch.bfloat16}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def topk(numel=20, idx=(1, 4, 7), dtype=ps_pb2.FLOAT32, values=None, offset=0, name="w", **more):
    v = torch.arange(1, len(idx) + 1, dtype=DTYPES[dtype]) if values is None else values
    fields = dict(name=name, offset=offset, dtype=dtype, encoding=compressed.TOPK, numel=numel,
                  indices=_bytes(torch.tensor(idx, dtype=compressed.index_dtype(numel))), data=_bytes(v))
    fields.update(more)
    return ps_pb2.Chunk(**fields)


def lowrank(rows=4, cols=5, rank=2, offset=0, p=None, q=None, **more):
    p = torch.ones(rows, rank) if p is None else p
    q = torch.ones(cols, rank) if q is None else q
    fields = dict(name="w", offset=offset, dtype=ps_pb2.FLOAT32, encoding=compressed.LOWRANK, numel=rows * cols,
                  rank=rank, data=_bytes(p), factor=_bytes(q))
    fields.update(more)
    return ps_pb2.Chunk(**fields)


@pytest.mark.parametrize("seed", range(20))
def test_packed_messages_are_protobufs_bytes(seed):
    rng = random.Random(seed)
    dtype = rng.choice(list(DTYPES))
    n = rng.randrange(1, 3000)
    values = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100).to(DTYPES[dtype])
    if rng.random() < 0.5:
        fields = dict(encoding=compressed.TOPK, numel=rng.randrange(n, 1 << 40),
                      indices=_bytes(torch.arange(n, dtype=torch.int64) * 3))
    else:
        fields = dict(encoding=compressed.LOWRANK, numel=n * 7, rank=rng.randrange(1, 9),
                      factor=bytes(rng.randrange(256) for _ in range(rng.randrange(0, 500))))
    chunk = dict(name=f"layer.{seed}", offset=rng.randrange(0, 1 << 50), dtype=dtype,
                 shape=[rng.randrange(1, 500) for _ in range(rng.randrange(0, 4))], **fields)
    head = dict(worker_id=rng.randrange(1 << 20), step=rng.randrange(1 << 40), base_version=rng.randrange(1 << 30),
                found_inf=rng.random() < 0.5, loss_scale=rng.choice([0.0, 1024.0]), epoch=rng.randrange(5),
                ends_with_last=True, last=rng.random() < 0.5)
    prefix, suffix = framing.header(ps_pb2.PushRequest, **head)
    msg = framing.packed_message(prefix, framing.PUSH_CHUNK_FIELD, suffix, values, **chunk)
    expected = ps_pb2.PushRequest(chunk=ps_pb2.Chunk(data=_bytes(values), **chunk), **head)
    assert msg == expected.SerializeToString()
    parsed = framing.parse_push_request(msg)  # the shard's parser reads every field, the data as a view
    assert bytes(parsed.chunk.data) == _bytes(values)
    assert (parsed.chunk.encoding, parsed.chunk.numel, parsed.chunk.indices, parsed.chunk.rank,
            parsed.chunk.factor) == (expected.chunk.encoding, expected.chunk.numel, expected.chunk.indices,
                                     expected.chunk.rank, expected.chunk.factor)


# Each chunk is refused by ``check`` with a message holding every fragment (shape of the tensor: (4, 5)).
BAD = {
    "dense with indices": (ps_pb2.Chunk(name="w", dtype=ps_pb2.FLOAT32, data=b"\0" * 8, indices=b"\0" * 4),
                           ["dense chunk carries"]),
    "unknown encoding": (topk(encoding=7), ["encoding expected one of", "<unknown encoding 7>"]),
    "no numel": (topk(numel=0, idx=()), ["numel > 0", "got 0"]),
    "negative numel": (topk(numel=-5, idx=(), data=b""), ["numel > 0", "got -5"]),
    "ragged values": (topk(data=b"\0" * 13), ["13 bytes", "float32"]),
    "more values than elements": (topk(numel=2, idx=(0, 1, 1)), ["3 values for a range of 2"]),
    "short indices": (topk(indices=b"\0" * 8), ["indices expected 12 bytes", "3 x int32", "got 8"]),
    "int64 indices for a small range": (topk(indices=_bytes(torch.tensor([1, 4, 7]))),
                                        ["indices expected 12 bytes", "got 24"]),
    "index past the end": (topk(idx=(1, 4, 20)), ["indices expected in [0, 20)", "got [1, 20]"]),
    "negative index": (topk(idx=(-1, 4, 7)), ["indices expected in [0, 20)", "got [-1, 7]"]),
    "duplicate index": (topk(idx=(1, 4, 4)), ["strictly ascending", "got 4 after 4 at position 2"]),
    "descending indices": (topk(idx=(1, 9, 7)), ["strictly ascending", "got 7 after 9"]),
    "topk with a factor": (topk(factor=b"\0" * 4), ["topk chunk carries rank or factor"]),
    "topk in shared memory": (topk(shm_bytes=12), ["lies in shared memory"]),
    "lowrank with indices": (lowrank(indices=b"\0" * 4), ["lowrank chunk carries indices"]),
    "lowrank rank 0": (lowrank(rank=0, data=b"", factor=b""), ["rank expected in [1, 1024]", "got 0"]),
    "lowrank rank too large": (lowrank(rank=2000, data=b"", factor=b""), ["rank expected in [1, 1024]", "got 2000"]),
    "lowrank not whole rows": (lowrank(offset=3), ["[3, 23) is not whole rows of 5 elements"]),
    "lowrank ragged range": (lowrank(numel=18), ["[0, 18) is not whole rows"]),
    "lowrank short P": (lowrank(data=b"\0" * 28), ["data (P) expected 4 x 2 elements", "got 7"]),
    "lowrank short Q": (lowrank(factor=b"\0" * 36), ["factor (Q) expected 5 x 2 elements", "got 9"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_chunks_are_refused_saying_what_was_expected_and_what_came(case):
    chunk, fragments = BAD[case]
    with pytest.raises(ValueError) as err:
        compressed.check(chunk, (4, 5))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_lowrank_needs_a_matrix():
    with pytest.raises(ValueError, match=r"shape \[20\] has no matrix view"):
        compressed.check(lowrank(), (20,))


def test_expand_writes_the_dense_values():
    out = torch.full((20,), 9.0)
    c = topk(idx=(0, 5, 19), values=torch.tensor([1.5, -2.0, 3.0]))
    compressed.check(c, (4, 5))
    compressed.expand(c, (4, 5), out)
    want = torch.zeros(20)
    want[[0, 5, 19]] = torch.tensor([1.5, -2.0, 3.0])
    assert torch.equal(out, want)
    p, q = torch.randn(2, 3), torch.randn(5, 3)  # rows 1..2 of a (4, 5) tensor
    c = lowrank(rows=2, rank=3, offset=5, p=p, q=q)
    compressed.check(c, (4, 5))
    out = torch.empty(10)
    compressed.expand(c, (4, 5), out)
    torch.testing.assert_close(out.view(2, 5), p @ q.T)
    assert compressed.span(c) == 10 and compressed.payload_bytes(c) == (6 + 15) * 4


def test_index_width_follows_the_range():
    assert compressed.index_dtype(1 << 31) == torch.int32 and compressed.index_dtype((1 << 31) + 1) == torch.int64
    big = topk(numel=(1 << 31) + 5, idx=(0, (1 << 31) + 4))
    compressed.check(big, ((1 << 31) + 5,))  # int64 indices past 2^31
