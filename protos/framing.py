"""Chunk-carrying messages framed by hand: protobuf's wire format, one copy of the data.

Protobuf Python (upb) copies a ``bytes`` field on every hop: tensor ->
``bytes``, ``bytes`` -> message, message -> wire on the way out; wire ->
message and message -> ``chunk.data`` on the way in. For the tensor data of
Push and Pull that is most of the cost of the data path, so these helpers
handle the one ``chunk.data`` field themselves:

* ``chunk_messages`` writes whole messages (e.g. ``PushRequest``) as bytes:
  every other field is serialized by protobuf, the data is appended straight
  from the tensor's memory (one copy). The result is byte-for-byte what
  ``SerializeToString`` gives for the same message, so any client or server
  using the generated stubs reads it. ``packed_message`` does the same for
  one compressed chunk (protos/compressed.py: its indices or factor are
  serialized by protobuf, its values copied once).
* ``parse_push_request`` / ``parse_pull_response`` are gRPC deserializers:
  protobuf parses everything but ``chunk.data``, which stays a
  ``memoryview`` of the received buffer (no copy). (``read_push_request`` /
  ``read_pull_response``, what the servers and workers use, parse a small
  message whole instead: its copy is cheaper than the split.) The result reads like the
  message (``.worker_id``, ``.HasField("chunk")``, ``.chunk.offset``...);
  ``chunk.data`` is the view. Anything unusual on the wire (a repeated chunk
  or data field, odd wire types, a malformed buffer) falls back to
  ``FromString`` on the whole buffer, which gives protobuf's own answer and
  its own errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shardps.protos.shardps.v1 import ps_pb2

_LEN = 2  # wire type of length-delimited fields
_DATA_FIELD = ps_pb2.Chunk.DESCRIPTOR.fields_by_name["data"].number
_DATA_KEY = bytes([(_DATA_FIELD << 3) | _LEN])


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (negative numbers as 64-bit two's complement)."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int) -> bytes:
    return varint((field << 3) | _LEN)


def header(message_cls: Any, chunk_field: str = "chunk", **fields: Any) -> tuple[bytes, bytes]:
    """The serialized fields of ``message_cls(**fields)`` that go before and after ``chunk_field``.

    ``prefix + <chunk field> + suffix`` is exactly protobuf's serialization
    (it writes fields in number order); ``prefix + suffix`` is the message
    without a chunk.
    """
    by_name = message_cls.DESCRIPTOR.fields_by_name
    number = by_name[chunk_field].number
    before = {k: v for k, v in fields.items() if by_name[k].number < number}
    after = {k: v for k, v in fields.items() if by_name[k].number > number}
    return message_cls(**before).SerializeToString(), message_cls(**after).SerializeToString()


def pull_header(version: int, loss_scale: float, sync: str, slowest_clock: int) -> tuple[bytes, bytes]:
    """``header`` of a PullResponse."""
    return header(ps_pb2.PullResponse, version=version, loss_scale=loss_scale, sync=sync,
                  slowest_clock=slowest_clock)


def frame(prefix: bytes, chunk_field: int, chunk_head: bytes, data: Any, chunk_tail: bytes,
          suffix: bytes) -> bytes:
    """One message: ``prefix``, a Chunk (``chunk_head`` + data field + ``chunk_tail``), ``suffix``.

    ``data`` is any contiguous bytes-like object; it is copied once, into
    the result. ``chunk_head`` holds the Chunk's fields numbered below
    ``data``, ``chunk_tail`` those above.
    """
    n = memoryview(data).nbytes
    if n:
        dlen = varint(n)
        body = len(chunk_head) + len(_DATA_KEY) + len(dlen) + n + len(chunk_tail)
        parts: tuple[Any, ...] = (prefix, _key(chunk_field), varint(body), chunk_head, _DATA_KEY, dlen, data,
                                  chunk_tail, suffix)
    else:  # proto3 leaves an empty bytes field out
        body = len(chunk_head) + len(chunk_tail)
        parts = (prefix, _key(chunk_field), varint(body), chunk_head, chunk_tail, suffix)
    return b"".join(parts)


def chunk_messages(prefix: bytes, chunk_field: int, suffix: bytes, name: str, dtype: int,
                   shape: Sequence[int], flat: torch.Tensor, start: int, stop: int,
                   chunk_bytes: int, base: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """Messages whose chunks cover ``flat[start:stop]``: ``(offset, data bytes, message)``.

    Each message is ``prefix`` + a Chunk in field ``chunk_field`` + ``suffix``
    (see ``header``). Chunk offsets are ``base + i`` for element ``i`` of
    ``flat``; ``shape`` goes on the first chunk only (pass ``()`` for none).
    ``flat`` is a contiguous 1-D CPU tensor; its elements are copied once,
    straight into the message. As ``codec.encode_range``, a chunk holds at
    most ``chunk_bytes`` (at least one element) and an empty range gives
    nothing.
    """
    if start >= stop:
        return
    size = flat.element_size()
    step = max(1, chunk_bytes // size)
    raw = flat.detach().view(torch.uint8).numpy()
    tail = ps_pb2.Chunk(shape=shape).SerializeToString() if shape else b""
    for a in range(start, stop, step):
        b = min(stop, a + step)
        head = ps_pb2.Chunk(name=name, offset=base + a, dtype=dtype).SerializeToString()  # type: ignore[arg-type]
        yield base + a, (b - a) * size, frame(prefix, chunk_field, head, raw[a * size : b * size], tail, suffix)
        tail = b""


def packed_message(prefix: bytes, chunk_field: int, suffix: bytes, values: torch.Tensor, **chunk: Any) -> bytes:
    """One message whose Chunk has the fields ``chunk`` (any but data: a compressed chunk's indices, factor...)
    and ``values``' bytes as its data, copied once from the tensor (a contiguous 1-D CPU tensor).

    Byte for byte protobuf's serialization of the message with
    ``Chunk(data=<values' bytes>, **chunk)`` in ``chunk_field`` (see ``header``).
    """
    head, tail = header(ps_pb2.Chunk, "data", **chunk)
    return frame(prefix, chunk_field, head, values.detach().view(torch.uint8).numpy(), tail, suffix)


# -- parsing without copying chunk.data ------------------------------------


class _Fallback(Exception):
    """The buffer is not in the simple form the fast parser handles."""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]  # IndexError past the end
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise _Fallback


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, key start, value start, value end) of each field in buf[pos:end]."""
    while pos < end:
        key_at = pos
        key, pos = _read_varint(buf, pos)
        field, wt = key >> 3, key & 7
        if field == 0:
            raise _Fallback
        if wt == 0:
            stop = _read_varint(buf, pos)[1]
        elif wt == 1:
            stop = pos + 8
        elif wt == 5:
            stop = pos + 4
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos)
            stop = pos + n
        else:  # groups and invalid wire types
            raise _Fallback
        if stop > end:
            raise _Fallback
        yield field, wt, key_at, pos, stop
        pos = stop
    if pos != end:
        raise _Fallback


def _only(spans: list[tuple[int, int, int, int, int]], field: int) -> tuple[int, int, int, int, int] | None:
    """The one occurrence of ``field`` (length-delimited); _Fallback if it repeats or has another wire type."""
    hits = [s for s in spans if s[0] == field]
    if not hits:
        return None
    if len(hits) > 1 or hits[0][1] != _LEN:
        raise _Fallback
    return hits[0]


def split_data(buf: bytes, chunk_field: int) -> tuple[bytes, memoryview] | None:
    """``buf`` without its ``chunk.data`` field, and that field's value as a view of ``buf``.

    None when there is nothing to split off (no chunk, or a chunk without
    data) or when ``buf`` is not in the form protobuf writes (then only
    ``FromString`` gives the right answer).
    """
    mv = memoryview(buf)
    try:
        spans = list(_fields(mv, 0, len(mv)))
        chunk = _only(spans, chunk_field)
        if chunk is None:
            return None
        _, _, key_at, a, b = chunk
        data = _only(list(_fields(mv, a, b)), _DATA_FIELD)
        if data is None:
            return None
        _, _, dkey_at, da, db = data
    except (_Fallback, IndexError):
        return None
    body = b"".join((mv[a:dkey_at], mv[db:b]))
    head = b"".join((mv[:key_at], _key(chunk_field), varint(len(body)), body, mv[b:]))
    return head, mv[da:db]


class ChunkView:
    """A Chunk whose ``data`` is a memoryview of the received buffer; other fields as parsed.

    The fields every receiver reads per chunk are plain attributes (a delegated read costs ~10x more).
    """

    __slots__ = ("_chunk", "data", "name", "offset", "dtype", "shape", "encoding", "numel", "indices", "rank",
                 "factor")

    def __init__(self, chunk: Any, data: memoryview) -> None:
        self._chunk = chunk
        self.data = data
        self.name, self.offset, self.dtype, self.shape = chunk.name, chunk.offset, chunk.dtype, chunk.shape
        # what every chunk's check reads (protos/compressed.py ``check``)
        self.encoding, self.numel, self.indices = chunk.encoding, chunk.numel, chunk.indices
        self.rank, self.factor = chunk.rank, chunk.factor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._chunk, name)

    def __repr__(self) -> str:
        return f"ChunkView(name={self._chunk.name!r}, offset={self._chunk.offset}, data=<{len(self.data)} bytes>)"


class FramedMessage:
    """A parsed message whose ``chunk.data`` was not copied. Reads like the message."""

    __slots__ = ("_msg", "chunk")

    def __init__(self, msg: Any, data: memoryview) -> None:
        self._msg = msg
        self.chunk = ChunkView(msg.chunk, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._msg, name)

    def to_message(self) -> Any:
        """A real protobuf message equal to what was received (copies the data)."""
        msg = type(self._msg)()
        msg.CopyFrom(self._msg)
        msg.chunk.data = bytes(self.chunk.data)
        return msg

    def __repr__(self) -> str:
        return f"FramedMessage({type(self._msg).__name__}, chunk={self.chunk!r})"


def parser(message_cls: Any, chunk_field: str = "chunk", copy_below: int = 0) -> Callable[[bytes], Any]:
    """A gRPC deserializer for ``message_cls`` that leaves ``chunk.data`` uncopied.

    Returns a ``FramedMessage`` when the message carries chunk data, else
    the plain ``message_cls.FromString(buf)`` (which also gives protobuf's
    own error for a malformed buffer). A buffer shorter than ``copy_below``
    bytes is parsed whole by ``FromString``: copying a small chunk's data
    costs less than splitting it off here.
    """
    number = message_cls.DESCRIPTOR.fields_by_name[chunk_field].number
    from_string = message_cls.FromString

    def parse(buf: bytes) -> Any:
        if len(buf) < copy_below:
            return from_string(buf)
        split = split_data(buf, number)
        if split is None:
            return from_string(buf)
        head, data = split
        return FramedMessage(from_string(head), data)

    parse.__qualname__ = parse.__name__ = f"parse_{message_cls.__name__}"
    return parse


parse_push_request = parser(ps_pb2.PushRequest)
parse_pull_response = parser(ps_pb2.PullResponse)
# The deserializers of Push's requests (the servers) and Pull's responses (the workers): under
# COPY_BELOW bytes a message is parsed whole (64 KiB: FromString's copy takes about 1 us, the split
# about 5 us plus slower field reads through the view); above, its data stays a view.
COPY_BELOW = 64 << 10

read_push_request = parser(ps_pb2.PushRequest, copy_below=COPY_BELOW)
read_pull_response = parser(ps_pb2.PullResponse, copy_below=COPY_BELOW)
PUSH_CHUNK_FIELD = ps_pb2.PushRequest.DESCRIPTOR.fields_by_name["chunk"].number
PULL_CHUNK_FIELD = ps_pb2.PullResponse.DESCRIPTOR.fields_by_name["chunk"].number


# -- PullRowsResponse (row tables, docs/sparse.md) ---------------------------

_PULL_ROWS_FIELDS = {f.name: f.number for f in ps_pb2.PullRowsResponse.DESCRIPTOR.fields}


def pull_rows_message(first: int, rows: memoryview, versions: memoryview) -> bytes:
    """A PullRowsResponse as bytes, byte for byte what protobuf serialises: the rows' and versions' bytes
    copied once, straight from their contiguous buffers into the message."""
    parts: list[bytes | memoryview] = [varint(_PULL_ROWS_FIELDS["first"] << 3), varint(first)] if first else []
    for name, data in (("rows", rows), ("versions", versions)):
        if data.nbytes:  # proto3 leaves an empty bytes field out
            parts += [_key(_PULL_ROWS_FIELDS[name]), varint(data.nbytes), data]
    return b"".join(parts)


def read_pull_rows(buf: bytes) -> tuple[int, memoryview, memoryview]:
    """(first, rows, versions) of a serialised PullRowsResponse (a gRPC deserializer's bytes); rows and versions
    are views of ``buf``, not copies. A message in another form than ``pull_rows_message`` writes (a field
    repeated, unknown fields, odd wire types) is parsed by protobuf, whose errors it raises."""
    mv = memoryview(buf)
    got: dict[int, int | memoryview] = {}
    try:
        for field, wt, _, a, b in _fields(mv, 0, len(mv)):
            if field in got or (field, wt) not in ((_PULL_ROWS_FIELDS["first"], 0), (_PULL_ROWS_FIELDS["rows"], _LEN),
                                                    (_PULL_ROWS_FIELDS["versions"], _LEN)):
                raise _Fallback
            got[field] = _read_varint(mv, a)[0] if wt == 0 else mv[a:b]
    except (_Fallback, IndexError):
        msg = ps_pb2.PullRowsResponse.FromString(buf)
        return msg.first, memoryview(msg.rows), memoryview(msg.versions)
    first = got.get(_PULL_ROWS_FIELDS["first"], 0)
    rows = got.get(_PULL_ROWS_FIELDS["rows"], mv[:0])
    versions = got.get(_PULL_ROWS_FIELDS["versions"], mv[:0])
    assert isinstance(first, int) and isinstance(rows, memoryview) and isinstance(versions, memoryview)
    return first, rows, versions
