"""``PushFramer``: the one place a Push's messages are made, for every way a push travels.

A shard's Push of one step is a stream of serialized PushRequests that
share one header (worker, step, base version, loss scale, epoch,
``ends_with_last``, and for a plain push ``found_inf`` and ``pull_after``);
the last message says it is (``last``), so a cut stream is refused. The
chunks travel two ways (a plain push's compressed chunks, ``packed``,
always in the messages: worker/compress.py):

- gRPC (``chunks``): the gradient's bytes copied once, straight into the
  message (``protos/framing.py``);
- shared memory (``shm_chunks``): the bytes already lie in the shard's push
  segment (``ShmLink.write``); each message says where.

A plain push knows its ``found_inf`` first and marks its last chunk message
as the last (``ending``: a one-message push goes as one unary call); a
streamed push sends its chunks with ``found_inf=False`` and ends with a
chunk-less message carrying the step's flag (``end``), as the shards
require (server/datapath/headers.py: only a stream's last message may raise it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardps.protos import framing
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.compress import PackedChunk


class PushFramer:
    """One shard's PushRequests of one step (see the module docstring).

    ``found_inf`` goes on every message but a streamed push's ``end``;
    ``fields``: more header fields for every message (``pull_after``...);
    ``shm``: the name of the shard's push segment, for ``shm_chunks`` and
    ``end`` (empty: gRPC). Cheap to make: headers are serialized on first
    use. Not thread-safe (one per shard and call).
    """

    def __init__(self, *, worker_id: int, step: int, base_version: int, loss_scale: float, epoch: int,
                 sync: tuple[str, int], found_inf: bool = False, fields: Mapping[str, Any] | None = None,
                 shm: str = "", packed: Sequence[PackedChunk] = (), fence_epoch: int = 0) -> None:
        self._head: dict[str, Any] = dict(worker_id=worker_id, step=step, base_version=base_version,
                                          loss_scale=loss_scale, epoch=epoch, ends_with_last=True,
                                          sync=sync[0], sync_switch=sync[1], **(fields or {}))
        if fence_epoch:  # the shard's fencing epoch (--coordinator): left out without one, as before
            self._head["fence_epoch"] = fence_epoch
        self._found_inf = found_inf
        self._shm = shm
        self._packed = packed
        self._framing: tuple[bytes, bytes] | None = None  # (prefix, suffix) around a gRPC chunk
        self._last_suffix: bytes | None = None

    def _prefix_suffix(self) -> tuple[bytes, bytes]:
        if self._framing is None:
            self._framing = framing.header(ps_pb2.PushRequest, found_inf=self._found_inf, **self._head)
        return self._framing

    def chunks(self, name: str, dtype: int, shape: Sequence[int], flat: torch.Tensor, start: int, stop: int,
               chunk_bytes: int) -> Iterator[bytes]:
        """gRPC messages carrying ``flat[start:stop]`` (``flat``: the tensor's flat CPU values in ``dtype``,
        contiguous), at most ``chunk_bytes`` of data each; none says it is the last."""
        prefix, suffix = self._prefix_suffix()
        for _, _, msg in framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, name, dtype, shape, flat,
                                                start, stop, chunk_bytes):
            yield msg

    def ending(self, messages: Iterable[bytes]) -> Iterator[bytes]:
        """``messages`` (from ``chunks``) with the last one made the stream's last; a chunk-less last
        message when there are none. Holds one message back: nothing is copied again."""
        prefix, suffix = self._prefix_suffix()
        if self._last_suffix is None:
            _, self._last_suffix = framing.header(ps_pb2.PushRequest, found_inf=self._found_inf, last=True,
                                                  **self._head)
        last_suffix = self._last_suffix
        pending = None
        for msg in itertools.chain(messages, self._packed_messages()):
            if pending is not None:
                yield pending
            pending = msg
        # The fields after the chunk are the message's end (protobuf writes fields in number order).
        yield prefix + last_suffix if pending is None else pending[: len(pending) - len(suffix)] + last_suffix

    def _packed_messages(self) -> Iterator[bytes]:
        """gRPC messages carrying the compressed chunks (``packed``), the values copied once."""
        prefix, suffix = self._prefix_suffix()
        for c in self._packed:
            yield framing.packed_message(prefix, framing.PUSH_CHUNK_FIELD, suffix, c.values, **c.fields)

    def shm_chunks(self, chunks: Sequence[ps_pb2.Chunk], *, last: bool) -> Iterator[bytes]:
        """Messages for ``chunks`` already in the shard's push segment (one per chunk); ``last``: the last
        one says it is (a chunk-less last message when there are none), after the compressed chunks
        (``packed``: they carry their bytes in the message)."""
        head = dict(self._head, found_inf=self._found_inf, shm=self._shm)
        if last:
            chunks = [*chunks, *(c.proto() for c in self._packed)]
        requests = [ps_pb2.PushRequest(chunk=c, **head) for c in chunks]
        if not requests and last:
            requests = [ps_pb2.PushRequest(**head)]
        if requests:
            requests[-1].last = last
        for r in requests:
            yield r.SerializeToString()

    def end(self, found_inf: bool) -> bytes:
        """A streamed push's last message: no chunk, the step's ``found_inf``."""
        return ps_pb2.PushRequest(found_inf=found_inf, shm=self._shm, last=True, **self._head).SerializeToString()
