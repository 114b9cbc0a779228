"""A client's tensor bytes on the wire, counted by tensor: what the tests and benchmarks/tp.py measure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import shardps
from shardps.protos.shardps.v1 import ps_pb2


def count_wire(client: shardps.PSClient) -> tuple[Counter[str], Counter[str]]:
    """From now on, count the tensor bytes ``client`` receives and sends on the wire, by tensor: the payload of
    every Pull response's chunk, and of every Push message's chunk (bytes in the messages: gRPC's path, or a
    data connection's calls that carry them so, as a tensor-parallel rank's slices)."""
    pulled: Counter[str] = Counter()
    pushed: Counter[str] = Counter()
    t = client.transport
    pull, push = t.pull, t.push

    def counted_pull(shard: int, request: Any, *, one: bool = False, via: Any = None,
                     place: Any = None) -> Iterator[Any]:
        for resp in pull(shard, request, one=one, via=via, place=place):
            pulled[resp.chunk.name] += len(resp.chunk.data)
            yield resp

    def counted_push(shard: int, requests: Iterator[bytes], *, stream: bool = False, via: Any = None) -> Any:
        def each() -> Iterator[bytes]:
            for msg in requests:
                chunk = ps_pb2.PushRequest.FromString(msg).chunk
                pushed[chunk.name] += len(chunk.data)
                yield msg
        return push(shard, each(), stream=stream, via=via)

    t.pull, t.push = counted_pull, counted_push  # type: ignore[method-assign]
    return pulled, pushed
