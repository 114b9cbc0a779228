"""Cross-shard reduction of optimizer statistics for split tensors: the gRPC side.

Optimizers whose update depends on more than one element (Adafactor's row
and column statistics and RMS scalars, SM3's per-axis maxima) call
``reduce(tag, partial, op)``. For a tensor held whole this is the identity.
For a tensor split across shards (one part per shard, see the shard map),
each shard publishes its partial in its ``ExchangeTable`` and fetches the
others' partials with the ``Exchange`` RPC, then combines all of them in
shard order, so every shard computes exactly the same value.

Split non-elementwise tensors need a barrier sync mode (bsp, every:X): every
shard then steps the tensor once per step, and ``round`` (the tensor's step
count) names the same step on every shard.

``PeerChannels`` is the gRPC implementation of ``peers.Peers`` the server
gives its store (``service Peers``, with the peer token); the table and the reduction themselves are in
server/replication/peers.py (no network).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc
import torch

from shardps.protos import codec
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.errors import Unavailable
from shardps.server.replication.peers import ExchangeTable, Key, PeerReducer

__all__ = ["ExchangeTable", "Key", "PeerChannels", "PeerReducer", "decode_partial", "encode_partial"]

def encode_partial(t: torch.Tensor) -> ps_pb2.Chunk:
    flat = t.detach().to(torch.float32).contiguous().view(-1)
    data = flat.view(torch.uint8).numpy().tobytes()
    return ps_pb2.Chunk(offset=0, dtype=ps_pb2.FLOAT32, data=data, shape=list(t.shape))


def decode_partial(c: ps_pb2.Chunk) -> torch.Tensor:
    return codec.decode(c.data, c.dtype).clone().view(tuple(c.shape))


class PeerChannels:
    """Lazily opened channels to the other shards, by index (``peers.Peers`` over gRPC)."""

    def __init__(self, security: Security | None = None) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[str, ps_pb2_grpc.PeersStub] = {}
        self._channels: list[grpc.Channel] = []
        self.addresses: list[str] = []
        self.security = security or Security()  # the shard's own settings: peers are served alike

    def set_addresses(self, addresses: Sequence[str]) -> None:
        with self._lock:
            if addresses and not self.addresses:
                self.addresses = list(addresses)

    def _stub(self, shard: int) -> ps_pb2_grpc.PeersStub:
        with self._lock:
            if shard >= len(self.addresses):
                raise Unavailable(f"no address known for shard {shard}")
            addr = self.addresses[shard]
            stub = self._stubs.get(addr)
            if stub is None:
                ch = self.security.channel(addr, role="peer")
                self._channels.append(ch)
                stub = self._stubs[addr] = ps_pb2_grpc.PeersStub(ch)  # type: ignore[no-untyped-call]
            return stub

    def fetch(self, shard: int, key: Key, from_shard: int, timeout: float) -> torch.Tensor:
        tensor, rnd, tag = key
        try:
            resp = self._stub(shard).Exchange(
                ps_pb2.ExchangeRequest(tensor=tensor, round=rnd, tag=tag, from_shard=from_shard),
                timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise Unavailable(f"tensor {tensor!r}: exchange of {tag!r} for step {rnd} with shard {shard} "
                              f"({self.addresses[shard]}) failed: {e.code().name}: {e.details()}") from None
        return decode_partial(resp.partial)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels, self._stubs = [], {}
