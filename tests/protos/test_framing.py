"""Hand-framed Push/Pull messages are protobuf's own bytes, and the zero-copy parser agrees with FromString."""

from __future__ import annotations

import random

import pytest
import torch
from google.protobuf.message import DecodeError

from shardps.protos import codec, framing
from shardps.protos.shardps.v1 import ps_pb2

DTYPES = {ps_pb2.FLOAT32: torch.float32, ps_pb2.FLOAT16: torch.float16, ps_pb2.BFLOAT16: torch.bfloat16}
INT64 = (-(1 << 63), -1, 0, 1, 127, 128, 300, (1 << 31) - 1, 1 << 40, (1 << 63) - 1)


def rand_int(rng: random.Random, bits: int = 63) -> int:
    if rng.random() < 0.3:
        return rng.choice([v for v in INT64 if -(1 << bits) <= v < (1 << bits)])
    if rng.random() < 0.3:
        return rng.randrange(-(1 << bits), 1 << bits)
    return rng.randrange(0, 1 << rng.randrange(1, bits))


def rand_float(rng: random.Random) -> float:
    return rng.choice([0.0, 1.0, -0.0, 65536.0, 2.0 ** -24, float("inf"), rng.uniform(-1e6, 1e6)])


def rand_name(rng: random.Random) -> str:
    return "".join(rng.choice("abc.XYZ_0123é🙂") for _ in range(rng.randrange(0, 40)))


def rand_shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rand_int(rng) if rng.random() < 0.1 else rng.randrange(0, 5000) for _ in range(rng.randrange(0, 5)))


def rand_flat(rng: random.Random, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return (torch.randn(n, generator=g) * 100).to(dtype)


def proto_chunks(flat, start, stop, chunk_bytes, name, dtype, shape, base=0):
    """The chunks the protobuf-only code path sends (codec.encode_range, shape on the first)."""
    out = []
    for off, data in codec.encode_range(flat, start, stop, chunk_bytes):
        out.append(ps_pb2.Chunk(name=name, offset=base + off, dtype=dtype, data=data,
                                shape=shape if not out else ()))
    return out


def assert_same(parsed, expected) -> None:
    """The parser's result reads the same as FromString's, on every field."""
    for field in expected.DESCRIPTOR.fields:
        if field.name == "chunk":
            continue
        assert getattr(parsed, field.name) == getattr(expected, field.name), field.name
    assert parsed.HasField("chunk") == expected.HasField("chunk")
    c, e = parsed.chunk, expected.chunk
    assert (c.name, c.offset, c.dtype, tuple(c.shape)) == (e.name, e.offset, e.dtype, tuple(e.shape))
    assert bytes(c.data) == e.data and len(c.data) == len(e.data)
    if isinstance(parsed, framing.FramedMessage):
        assert parsed.to_message() == expected


@pytest.mark.parametrize("seed", range(40))
def test_push_requests_are_protobufs_bytes(seed):
    rng = random.Random(seed)
    dtype = rng.choice(list(DTYPES))
    n = rng.choice([1, 2, 3, 7, 255, 256, 1000, 4097, rng.randrange(1, 20000)])
    flat = rand_flat(rng, DTYPES[dtype], n)
    start = rng.randrange(0, n)
    stop = rng.randrange(start, n + 1)
    chunk_bytes = rng.choice([1, 2, 3, 7, 1024, 4096, 5000, 1 << 20])
    fields = dict(worker_id=rand_int(rng, 31), step=rand_int(rng), base_version=rand_int(rng),
                  found_inf=rng.random() < 0.5, loss_scale=rand_float(rng))
    name, shape = rand_name(rng), rand_shape(rng)
    prefix, suffix = framing.header(ps_pb2.PushRequest, **fields)
    framed = list(framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, name, dtype, shape,
                                         flat, start, stop, chunk_bytes))
    expected = [ps_pb2.PushRequest(**fields, chunk=c)
                for c in proto_chunks(flat, start, stop, chunk_bytes, name, dtype, shape)]
    assert len(framed) == len(expected)
    for (off, nbytes, msg), exp in zip(framed, expected):
        assert msg == exp.SerializeToString()
        assert ps_pb2.PushRequest.FromString(msg) == exp
        assert (off, nbytes) == (exp.chunk.offset, len(exp.chunk.data))
        parsed = framing.parse_push_request(msg)
        assert isinstance(parsed, framing.FramedMessage)
        assert isinstance(parsed.chunk.data, memoryview)
        assert_same(parsed, exp)
        values = codec.decode(parsed.chunk.data, parsed.chunk.dtype)  # as ChunkAssembler reads it
        assert values.dtype == DTYPES[dtype]
        assert torch.equal(values.view(torch.uint8), flat[off : off + values.numel()].view(torch.uint8))
    # No chunk at all (a worker with no gradients for this shard).
    bare = prefix + suffix
    assert bare == ps_pb2.PushRequest(**fields).SerializeToString()
    parsed = framing.parse_push_request(bare)
    assert_same(parsed, ps_pb2.PushRequest(**fields))
    assert not parsed.HasField("chunk")


@pytest.mark.parametrize("seed", range(40))
def test_pull_responses_are_protobufs_bytes(seed):
    rng = random.Random(1000 + seed)
    dtype = rng.choice(list(DTYPES))
    n = rng.choice([1, 3, 513, rng.randrange(1, 20000)])
    flat = rand_flat(rng, DTYPES[dtype], n)
    base = rng.choice([0, 1, rng.randrange(0, 1 << 40)])
    chunk_bytes = rng.choice([2, 5, 1024, 3000, 1 << 20])
    fields = dict(version=rand_int(rng), loss_scale=rand_float(rng), sync=rng.choice(["", "asp", "bsp", "ssp:3"]),
                  slowest_clock=rand_int(rng))
    name, shape = rand_name(rng), rand_shape(rng)
    prefix, suffix = framing.pull_header(**fields)
    framed = list(framing.chunk_messages(prefix, framing.PULL_CHUNK_FIELD, suffix, name, dtype, shape,
                                         flat, 0, n, chunk_bytes, base=base))
    expected = [ps_pb2.PullResponse(**fields, chunk=c)
                for c in proto_chunks(flat, 0, n, chunk_bytes, name, dtype, shape, base=base)]
    assert len(framed) == len(expected) >= 1
    for (_, _, msg), exp in zip(framed, expected):
        assert msg == exp.SerializeToString()
        assert ps_pb2.PullResponse.FromString(msg) == exp
        assert_same(framing.parse_pull_response(msg), exp)


def test_empty_data_is_left_out_as_protobuf_does():
    for field, cls, fields in ((framing.PUSH_CHUNK_FIELD, ps_pb2.PushRequest, dict(worker_id=3, found_inf=True)),
                               (framing.PULL_CHUNK_FIELD, ps_pb2.PullResponse, dict(version=2, sync="bsp"))):
        prefix, suffix = framing.header(cls, **fields)
        for chunk in (ps_pb2.Chunk(), ps_pb2.Chunk(name="w", offset=5, dtype=ps_pb2.FLOAT16, shape=[2, 3])):
            head = ps_pb2.Chunk(name=chunk.name, offset=chunk.offset, dtype=chunk.dtype).SerializeToString()
            tail = ps_pb2.Chunk(shape=chunk.shape).SerializeToString()
            msg = framing.frame(prefix, field, head, b"", tail, suffix)
            exp = cls(**fields, chunk=chunk)
            assert msg == exp.SerializeToString()
            assert_same(framing.parser(cls)(msg), exp)


def test_empty_range_gives_nothing():
    flat = torch.ones(4)
    assert list(framing.chunk_messages(b"", 4, b"", "w", ps_pb2.FLOAT32, (4,), flat, 2, 2, 1024)) == []
    assert list(framing.chunk_messages(b"", 4, b"", "w", ps_pb2.FLOAT32, (0,), torch.ones(0), 0, 0, 1024)) == []


def test_data_view_does_not_copy():
    data = torch.arange(1000, dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    buf = ps_pb2.PushRequest(worker_id=1,
                             chunk=ps_pb2.Chunk(name="w", dtype=ps_pb2.FLOAT32, data=data)).SerializeToString()
    parsed = framing.parse_push_request(buf)
    assert parsed.chunk.data.obj is buf  # a view of the received bytes
    assert bytes(parsed.chunk.data) == data


def test_varint_matches_protobuf():
    for v in (*INT64, 2 ** 35 + 17):
        if v == 0:  # proto3 leaves a zero out
            assert framing.varint(v) == b"\x00"
            continue
        assert framing.varint(v) == ps_pb2.Chunk(offset=v).SerializeToString()[1:]


@pytest.mark.parametrize("seed", range(20))
def test_unusual_but_valid_wire_forms_agree_with_fromstring(seed):
    """Merged repeats, reordered and unknown fields: whatever protobuf reads, the parser reads."""
    rng = random.Random(2000 + seed)

    def part(**kw):
        return ps_pb2.PushRequest(**kw).SerializeToString()

    def data(k):
        return bytes(rng.randrange(256) for _ in range(4 * k))

    pieces = [
        part(worker_id=rng.randrange(100), step=rng.randrange(100)),
        part(chunk=ps_pb2.Chunk(name="a", data=data(3))),
        part(chunk=ps_pb2.Chunk(offset=7, shape=[1, 2])),
        part(found_inf=True, loss_scale=2.0),
        part(chunk=ps_pb2.Chunk(data=data(2))),
        framing.varint(99 << 3) + b"\x05",  # unknown varint field 99
        framing.varint((98 << 3) | 2) + b"\x03xyz",  # unknown length-delimited field 98
        part(base_version=rng.randrange(100)),
    ]
    rng.shuffle(pieces)
    buf = b"".join(pieces[: rng.randrange(1, len(pieces) + 1)])
    exp = ps_pb2.PushRequest.FromString(buf)
    assert_same(framing.parse_push_request(buf), exp)
    # The chunk's fields reordered inside one chunk (data first, shape before name).
    body = (framing._DATA_KEY + framing.varint(8) + data(2)
            + ps_pb2.Chunk(shape=[4]).SerializeToString() + ps_pb2.Chunk(name="w", offset=3).SerializeToString())
    buf = part(worker_id=2) + framing.varint((4 << 3) | 2) + framing.varint(len(body)) + body + part(step=9)
    exp = ps_pb2.PushRequest.FromString(buf)
    parsed = framing.parse_push_request(buf)
    assert isinstance(parsed, framing.FramedMessage)
    assert_same(parsed, exp)


@pytest.mark.parametrize("bad", [
    b"\x22",  # chunk key without a length
    b"\x22\x05\x0a\x01",  # chunk longer than the buffer
    b"\x22\x04\x22\x10ab",  # data longer than its chunk
    b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # overlong varint
    b"\x0f",  # invalid wire type
])
def test_malformed_buffers_fail_as_fromstring_does(bad):
    with pytest.raises(DecodeError):
        ps_pb2.PushRequest.FromString(bad)
    with pytest.raises(DecodeError):
        framing.parse_push_request(bad)


def test_plain_protobuf_messages_still_talk_to_the_server(make_cluster):
    """Push and Pull with plain protobuf messages (as frames on a data connection), next to PSClient's framed
    path."""

    import shardps
    from shardps.testing.frames import FrameStub

    cluster = make_cluster(1)
    w = torch.randn(300, 7)
    b = torch.randn(5).to(torch.bfloat16)
    with shardps.connect(cluster.addresses, chunk_bytes=1024) as client:
        client.register({"w": w, "b": b}, shardps.optim.SGD(lr=1.0), sync="asp")
        with FrameStub(cluster.addresses[0]) as stub:  # the hand-framed messages as a data connection's frames
            gw = torch.randn(300, 7)
            data = gw.reshape(-1).numpy().tobytes()
            reqs = [ps_pb2.PushRequest(worker_id=0, step=0, loss_scale=2.0, chunk=ps_pb2.Chunk(
                        name="w", offset=0, dtype=ps_pb2.FLOAT32, data=data[:4000], shape=[300, 7])),
                    ps_pb2.PushRequest(worker_id=0, step=0, loss_scale=2.0, chunk=ps_pb2.Chunk(
                        name="w", offset=1000, dtype=ps_pb2.FLOAT32, data=data[4000:]))]
            r = stub.Push(iter(reqs), timeout=10)
            assert (r.version, r.applied, r.duplicate, r.sync) == (1, True, False, "asp")
            expected_w = w - gw / 2.0
            # The client's framed push next (a header-only Push for "b" is not needed: ASP).
            client.push({"b": torch.ones(5, dtype=torch.bfloat16)}, step=1)
            got = client.pull()
            assert torch.allclose(got["w"], expected_w)
            assert torch.equal(got["b"], b - 1)
            resps = stub.Pull(ps_pb2.PullRequest(names=["w", "b"], chunk_bytes=1024), timeout=10)
        assert all(isinstance(m, ps_pb2.PullResponse) for m in resps)
        assert {(m.version, m.loss_scale, m.sync, m.slowest_clock) for m in resps} == {(2, 0.0, "asp", 0)}
        flat_w = torch.empty(2100)
        for m in resps:
            if m.chunk.name == "w":
                v = codec.decode(m.chunk.data, m.chunk.dtype)
                flat_w[m.chunk.offset : m.chunk.offset + v.numel()] = v
        assert torch.equal(flat_w.view(300, 7), got["w"])
        firsts = [m for m in resps if m.chunk.shape]
        assert [(m.chunk.name, m.chunk.offset, tuple(m.chunk.shape)) for m in firsts] == [
            ("w", 0, (300, 7)), ("b", 0, (5,))]
        assert [m.chunk.dtype for m in resps if m.chunk.name == "b"] == [ps_pb2.BFLOAT16]


@pytest.mark.parametrize("read, cls", [(framing.read_push_request, ps_pb2.PushRequest),
                                       (framing.read_pull_response, ps_pb2.PullResponse)])
def test_the_grpc_deserializers_parse_small_messages_whole_and_keep_large_data_a_view(read, cls):
    for nbytes in (0, 4, 4096, framing.COPY_BELOW - 64, framing.COPY_BELOW, 1 << 20):
        data = torch.arange(nbytes // 4, dtype=torch.float32).view(torch.uint8).numpy().tobytes()
        exp = cls(chunk=ps_pb2.Chunk(name="w", offset=3, dtype=ps_pb2.FLOAT32, data=data))
        buf = exp.SerializeToString()
        parsed = read(buf)
        assert_same(parsed, exp)
        if len(buf) < framing.COPY_BELOW:
            assert parsed == exp  # a plain message
        else:
            assert isinstance(parsed, framing.FramedMessage) and parsed.chunk.data.obj is buf


@pytest.mark.parametrize("seed", range(20))
def test_pull_rows_messages_are_protobufs_bytes_and_read_back_as_views(seed):
    """A PullRowsResponse framed by hand is protobuf's serialisation (first 0 and empty fields left out as
    protobuf does); read_pull_rows gives its fields back, rows and versions as views of the buffer."""
    rng = random.Random(seed)
    n, dim = rng.choice([0, 1, 3, 1000]), rng.choice([1, 8, 64])
    first = rng.choice([0, 1, 300, (1 << 40) + 7])
    rows = torch.randn(n, dim)
    versions = torch.randint(-5, 1 << 40, (n,), dtype=torch.int64)
    buf = framing.pull_rows_message(first, rows.numpy().data, versions.numpy().data)
    want = ps_pb2.PullRowsResponse(first=first, rows=rows.numpy().tobytes(), versions=versions.numpy().tobytes())
    assert buf == want.SerializeToString()
    got_first, got_rows, got_versions = framing.read_pull_rows(buf)
    assert (got_first, bytes(got_rows), bytes(got_versions)) == (first, want.rows, want.versions)
    if n:
        assert got_rows.obj is buf  # a view of the received bytes, not a copy


def test_pull_rows_in_another_wire_form_is_read_by_protobuf():
    """Fields out of order, repeated (the last wins) or unknown: read as FromString reads them; a malformed
    buffer fails as FromString does."""
    a = ps_pb2.PullRowsResponse(first=5, rows=b"\x00" * 8).SerializeToString()
    b = ps_pb2.PullRowsResponse(rows=b"\x01" * 8, versions=b"\x02" * 16).SerializeToString()
    unknown = bytes([(9 << 3) | 0, 1])
    for buf in (b + a, a + b, a + unknown, unknown + b):
        msg = ps_pb2.PullRowsResponse.FromString(buf)
        first, rows, versions = framing.read_pull_rows(buf)
        assert (first, bytes(rows), bytes(versions)) == (msg.first, msg.rows, msg.versions)
    with pytest.raises(DecodeError):
        framing.read_pull_rows(a[:-3])
