"""Cross-shard reduction of optimizer statistics for split tensors.

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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc
import torch

from shardps.protos import codec
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.errors import DeadlineExceeded, InvalidArgument, Unavailable

Key = tuple[str, int, str]  # (tensor, round, tag)


class ExchangeTable:
    """Partials this shard has published, waited on by its peers. Own lock, never the store's."""

    def __init__(self, keep_rounds: int = 2) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._table: dict[Key, torch.Tensor] = {}
        self._keep = keep_rounds

    def publish(self, key: Key, partial: torch.Tensor) -> None:
        tensor, rnd, _ = key
        with self._cond:
            self._table[key] = partial.detach().to(torch.float32).contiguous().clone()
            for k in [k for k in self._table if k[0] == tensor and k[1] < rnd - self._keep]:
                del self._table[k]
            self._cond.notify_all()

    def wait(self, key: Key, timeout: float) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._table, timeout):
                raise DeadlineExceeded(
                    f"partial {key[2]!r} of tensor {key[0]!r} for step {key[1]} was not published "
                    f"within {timeout:.1f}s"
                )
            return self._table[key]


def encode_partial(t: torch.Tensor) -> ps_pb2.Chunk:
    flat = t.detach().to(torch.float32).contiguous().view(-1)
    data = flat.view(torch.uint8).numpy().tobytes()
    return ps_pb2.Chunk(offset=0, dtype=ps_pb2.FLOAT32, data=data, shape=list(t.shape))


def decode_partial(c: ps_pb2.Chunk) -> torch.Tensor:
    return codec.decode(c.data, c.dtype).clone().view(tuple(c.shape))


class PeerReducer:
    """The ``reduce`` of one split tensor's step on one shard."""

    def __init__(self, table: ExchangeTable, peers: PeerChannels, tensor: str, rnd: int,
                 shard_index: int, holders: Sequence[int], timeout: float) -> None:
        self.table, self.peers, self.tensor, self.rnd = table, peers, tensor, rnd
        self.shard_index, self.holders, self.timeout = shard_index, list(holders), timeout

    def __call__(self, tag: str, partial: torch.Tensor, op: str) -> torch.Tensor:
        if op not in ("sum", "max"):
            raise ValueError(f"reduce op must be 'sum' or 'max', got {op!r}")
        key = (self.tensor, self.rnd, tag)
        self.table.publish(key, partial)
        deadline = time.monotonic() + self.timeout
        parts = []
        for h in self.holders:
            if h == self.shard_index:
                parts.append(partial.to(torch.float32))
            else:
                parts.append(self.peers.fetch(h, key, self.shard_index, max(0.0, deadline - time.monotonic())))
        out = parts[0].clone()
        for p in parts[1:]:
            if p.shape != out.shape:
                raise InvalidArgument(f"tensor {self.tensor!r}: partial {tag!r} has shape {tuple(p.shape)} on a "
                                      f"peer, {tuple(out.shape)} here")
            if op == "sum":
                out.add_(p)
            else:
                torch.maximum(out, p, out=out)
        return out.to(partial.dtype)


class PeerChannels:
    """Lazily opened channels to the other shards, by index."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[str, ps_pb2_grpc.ParameterServerStub] = {}
        self._channels: list[grpc.Channel] = []
        self.addresses: list[str] = []
        self.security = Security()  # the shard's own settings: peers are served alike

    def set_addresses(self, addresses: Sequence[str]) -> None:
        with self._lock:
            if addresses and not self.addresses:
                self.addresses = list(addresses)

    def _stub(self, shard: int) -> ps_pb2_grpc.ParameterServerStub:
        with self._lock:
            if shard >= len(self.addresses):
                raise Unavailable(f"no address known for shard {shard}")
            addr = self.addresses[shard]
            stub = self._stubs.get(addr)
            if stub is None:
                ch = self.security.channel(addr)
                self._channels.append(ch)
                stub = self._stubs[addr] = ps_pb2_grpc.ParameterServerStub(ch)
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
