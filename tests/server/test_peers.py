"""The store steps a split tensor through injected in-process Peers: no network, no lock held over the call."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

import shardps
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.errors import Unavailable
from shardps.server.replication.peers import Key
from shardps.server.store import ShardStore, TensorSpec

SHAPE = (4, 3)
OPT = shardps.optim.Adafactor()


class FakePeers:
    """Peers answered from the other stores' exchange tables, in this process."""

    def __init__(self) -> None:
        self.stores: list[ShardStore] = []
        self.addresses: list[str] = []
        self.fetches = 0
        self.lock_free_during_fetch: list[bool] = []

    def set_addresses(self, addresses: Sequence[str]) -> None:
        if addresses and not self.addresses:
            self.addresses = list(addresses)

    def fetch(self, shard: int, key: Key, from_shard: int, timeout: float) -> torch.Tensor:
        me = self.stores[from_shard]
        free = me._cond.acquire(blocking=False)  # the caller's store must not hold its lock over the call
        if free:
            me._cond.release()
        self.lock_free_during_fetch.append(free)
        me.stats()  # another request is served meanwhile
        self.fetches += 1
        return self.stores[shard].applier.exchange.wait(key, timeout).clone()

    def close(self) -> None:
        pass


def _spec(part: tuple[int, int]) -> TensorSpec:
    return TensorSpec("w", SHAPE, ps_pb2.FLOAT32, OPT, (part,), peers=("a:1", "b:2"), holders=(0, 1))


def _split_stores(peers: FakePeers, w0: torch.Tensor) -> list[ShardStore]:
    flat = w0.reshape(-1)
    stores = []
    for i, (a, b) in enumerate([(0, 6), (6, 12)]):
        st = ShardStore(i, 2, sync="bsp", num_workers=1, peers=peers, exchange_timeout_s=10.0)
        st.path.register_tensors([_spec((a, b))], {("w", a): flat[a:b].clone()})
        st.leases.register(0)
        stores.append(st)
    peers.stores = stores
    return stores


def test_a_split_tensor_steps_through_fake_peers_like_the_whole_tensor():
    torch.manual_seed(0)
    w0 = torch.randn(SHAPE)
    grads = [torch.randn(SHAPE) for _ in range(3)]
    peers = FakePeers()
    stores = _split_stores(peers, w0)
    whole = ShardStore(0, 1, sync="bsp", num_workers=1)
    whole.path.register_tensors([TensorSpec("w", SHAPE, ps_pb2.FLOAT32, OPT, ((0, 12),))], {("w", 0): w0.reshape(-1)})
    whole.leases.register(0)
    for step, g in enumerate(grads):
        flat = g.reshape(-1)
        errors: list[BaseException] = []

        def push(st: ShardStore, a: int, b: int, step: int = step, flat: torch.Tensor = flat,
                 errors: list[BaseException] = errors) -> None:
            try:
                st.path.submit(0, step, step, {("w", a): flat[a:b].clone()})
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=push, args=(st, a, b)) for st, (a, b) in zip(stores, [(0, 6), (6, 12)])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        whole.path.submit(0, step, step, {("w", 0): flat.clone()})
    assert peers.fetches > 0 and all(peers.lock_free_during_fetch)
    got = torch.cat([stores[0].reader.weights("w")[0], stores[1].reader.weights("w")[6]]).reshape(SHAPE)
    want = whole.reader.weights("w")[0].reshape(SHAPE)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert [st.job.version for st in stores] == [3, 3]


def test_a_store_without_peers_refuses_a_split_step_and_is_not_left_applying():
    st = ShardStore(0, 2, sync="bsp", num_workers=1, exchange_timeout_s=0.5)
    st.path.register_tensors([_spec((0, 6))], {("w", 0): torch.ones(6)})
    st.leases.register(0)
    with pytest.raises(Unavailable, match="no connection to its peers"):
        st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)})
    assert not st.applier.applying
    st.reader.read(["w"], None)  # not stuck behind a step that ended
