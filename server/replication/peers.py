"""How a shard talks to other servers, as interfaces the store is given at start-up.

The store imports no gRPC and holds no channel: ``server/service.py``
(``create_server``) gives it gRPC implementations (``exchange.PeerChannels``
for ``Peers``, ``replication.GrpcReplicaLink`` for ``ReplicaLink``); tests
give it in-process fakes. The store never calls these while it holds its
lock (see the lock order in server/store.py): ``Peers.fetch`` runs with the
lock released, ``ReplicaLink.primary_serving`` outside the replay lock.

Also here, with no network: ``ExchangeTable`` (the partials this shard
publishes for its peers) and ``PeerReducer`` (the ``reduce`` of one split
tensor's step: publish, fetch the others' partials, combine in shard order,
so every shard computes exactly the same value).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from shardps.server.errors import DeadlineExceeded, InvalidArgument

Key = tuple[str, int, str]  # (tensor, round, tag)
Fetch = Callable[[int, Key, int, float], torch.Tensor]  # (shard, key, from_shard, timeout) -> partial


class Peers(Protocol):
    """The other shards of the job, by index (cross-shard statistics of split tensors)."""

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Every shard's address, in shard order (the first non-empty list given is kept)."""

    def fetch(self, shard: int, key: Key, from_shard: int, timeout: float) -> torch.Tensor:
        """The partial ``key`` that ``shard`` published (waiting for it up to ``timeout``); Unavailable on failure."""
        ...

    def close(self) -> None: ...


class ReplicaSink(Protocol):
    """The primary's end of its backup: takes ops under the store's lock, tells when they are safe."""

    address: str
    state: Any  # a ReplicaState
    ops_total: int
    last_error: str
    on_deposed: Callable[[str], None] | None
    fence_epoch: Callable[[], int]  # the sending primary's fencing epoch (--coordinator), carried by every op

    @property
    def lag(self) -> int: ...

    def record(self, kind: Any, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
               packed: Any = None) -> None: ...

    def begin_sync(self) -> None: ...

    def attach(self, address: str, snapshot: Callable[[], None]) -> None: ...

    def wait(self, seq: int | None, timeout: float) -> None: ...

    def wait_synced(self, timeout: float, settled: tuple[Any, ...] = ...) -> Any: ...

    def close(self) -> None: ...


class ReplicaLink(Protocol):
    """Opens replica sinks and asks a primary whether it still serves."""

    def sink(self, shard_index: int, num_shards: int, *, timeout_s: float, primary_address: str) -> ReplicaSink: ...

    def primary_serving(self, address: str) -> bool: ...


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


class PeerReducer:
    """The ``reduce`` of one split tensor's step on one shard."""

    def __init__(self, table: ExchangeTable, fetch: Fetch, tensor: str, rnd: int,
                 shard_index: int, holders: Sequence[int], timeout: float) -> None:
        self.table, self.fetch, self.tensor, self.rnd = table, fetch, tensor, rnd
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
                parts.append(self.fetch(h, key, self.shard_index, max(0.0, deadline - time.monotonic())))
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
