"""A client's tensor bytes on the wire, counted by tensor: what the tests and benchmarks/tp.py measure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import shardps
from shardps.protos.dataconn import FRAME_SEGMENT
from shardps.protos.shardps.v1 import ps_pb2


def count_wire(client: shardps.PSClient) -> tuple[Counter[str], Counter[str]]:
    """From now on, count the tensor bytes ``client`` receives and sends on its data connections, by tensor:
    the payload of every Pull response's chunk, and of every Push message's chunk (in the message, or after
    it in the frame; not what lies in shared memory). While it counts, every Push and Pull is a call made
    through the transport (none waits for nothing, none rides another's frame): what it counts."""
    pulled: Counter[str] = Counter()
    pushed: Counter[str] = Counter()
    t = client.transport
    pull, push = t.pull, t.push

    def counted_pull(shard: int, request: Any, *, via: Any, place: Any = None) -> Iterator[Any]:
        framed = request.shm == FRAME_SEGMENT
        for resp in pull(shard, request, via=via, place=place):
            pulled[resp.chunk.name] += len(resp.chunk.data) + (resp.chunk.shm_bytes if framed else 0)
            yield resp

    def counted_push(shard: int, requests: Iterator[bytes], *, stream: bool = False, via: Any) -> Any:
        return push(shard, _Counted(requests, pushed), stream=stream, via=via)

    t.pull, t.push = counted_pull, counted_push  # type: ignore[method-assign]
    client.paths.usable = lambda shard: False  # type: ignore[method-assign]  # every call through the two above
    return pulled, pushed


class _Counted:
    """A Push's messages, each counted as it goes; the extents their chunks name passed on (a whole push's on a
    data connection: worker/datapath/dataconn.py ``_Framed``)."""

    def __init__(self, requests: Iterator[bytes], pushed: Counter[str]) -> None:
        self._it, self._pushed = requests, pushed
        self.extents = getattr(requests, "extents", None)

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> bytes:
        msg = next(self._it)
        m = ps_pb2.PushRequest.FromString(msg)
        self._pushed[m.chunk.name] += len(m.chunk.data) + (m.chunk.shm_bytes if m.shm == FRAME_SEGMENT else 0)
        return msg
