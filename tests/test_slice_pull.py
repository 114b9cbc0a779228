"""Sliced pulls (PullRequest.slices, server/datapath/slicepull.py): a shard answers with a slice of a whole tensor only.

Real servers on loopback. Each slice pulled equals ``torch.chunk``'s of the whole tensor, along dim 0 and
along dim 1 (gathered by the shards from their row blocks), and the shards count exactly the slice's bytes
served (their ``pull_bytes_total``). Bad slice specs are INVALID_ARGUMENT naming the tensor, the expected and
the received, and change nothing.
"""

from __future__ import annotations

import grpc
import pytest
import torch

import shardps
from shardps.protos.dataconn import FRAME_SEGMENT
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.testing.frames import FrameStub
from shardps.worker.datapath.pull import PullInFlight

pytestmark = pytest.mark.cluster


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(10, 6, generator=g),   # rows split over the two shards (part_bytes below)
        "v": torch.randn(7, generator=g),       # a vector: flat ranges
        "qkv": torch.randn(12, 4, generator=g),  # three blocks of 4 rows, each chunked
        "t": torch.randn(4, 6, 3, generator=g),  # a slice along dim 2 of every row block
        "s": torch.tensor(2.5),                  # 0-d: pulled whole only
    }


def _expected(t: torch.Tensor, sl: TensorSlice) -> torch.Tensor:
    blocks = t.chunk(sl.blocks, sl.dim)
    pieces = []
    for b in blocks:
        chunks = b.chunk(sl.parts, sl.dim)
        pieces.append(chunks[sl.index] if sl.index < len(chunks) else b.narrow(sl.dim, 0, 0))
    return torch.cat(pieces, sl.dim)


def _pulled_bytes(client: shardps.PSClient) -> int:
    return sum(s["pull_bytes_total"] for s in client.stats())


def _pull(client: shardps.PSClient, slices: dict[str, TensorSlice], names: list[str] = (),  # type: ignore[assignment]
          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return PullInFlight(client, [*names, *slices], slices=slices, dtype=dtype, on_result=client.apply).start().result()


@pytest.fixture
def registered(cluster2: shardps.LocalCluster):
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=64)
    values = _tensors()
    client.register(values, shardps.optim.SGD(lr=0.1))
    yield client, values
    client.close()


CASES = [
    ("w", TensorSlice(0, 2, 0)), ("w", TensorSlice(0, 2, 1)), ("w", TensorSlice(0, 3, 2)),
    ("w", TensorSlice(1, 2, 1)), ("w", TensorSlice(1, 4, 3)), ("w", TensorSlice(1, 5, 4)),
    ("v", TensorSlice(0, 2, 1)), ("v", TensorSlice(0, 4, 3)), ("v", TensorSlice(0, 8, 7)),
    ("qkv", TensorSlice(0, 2, 1, 3)), ("qkv", TensorSlice(0, 4, 0, 3)), ("qkv", TensorSlice(1, 2, 0, 2)),
    ("t", TensorSlice(2, 2, 1)), ("t", TensorSlice(1, 4, 2)), ("t", TensorSlice(1, 3, 1, 2)),
]


@pytest.mark.parametrize(("name", "sl"), CASES)
def test_a_slice_is_torch_chunk_and_only_its_bytes_are_served(registered, name: str, sl: TensorSlice) -> None:
    client, values = registered
    assert len({p.server for p in client.shard_map.parts_of(name)}) == 2 or name in ("v",)
    before = _pulled_bytes(client)
    got = _pull(client, {name: sl})[name]
    served = _pulled_bytes(client) - before
    want = _expected(values[name], sl)
    assert torch.equal(got, want)
    assert served == want.numel() * 4  # counted by the shards: the slice's elements, nothing of the rest


@pytest.mark.parametrize("shm", [True, False])
def test_slices_and_whole_tensors_in_one_pull_in_bf16(cluster2: shardps.LocalCluster, shm: bool) -> None:
    """Both shards answer the path's way, the sliced Pull too: their bytes in the worker's shared memory when
    it has some, else in the frames' payload; none in the messages."""
    client = shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=64, shm=shm)
    values = _tensors()
    values["z"] = torch.randn(5, 3, generator=torch.Generator().manual_seed(8))
    client.register(values, shardps.optim.SGD(lr=0.1))
    assert all(link is not None for link in client.shm_links) == shm
    slices = {"z": TensorSlice(1, 3, 2)}
    shards = {n: {p.server for p in client.shard_map.parts_of(n)} for n in ("z", "s", "v")}
    assert not shards["z"] & (shards["s"] | shards["v"])  # one shard sliced, the other not
    before = _pulled_bytes(client)
    answers: list[ps_pb2.PullResponse] = []
    pull = client.transport.pull

    def seen(*args, **kw):  # type: ignore[no-untyped-def]
        for r in pull(*args, **kw):
            answers.append(r)
            yield r

    client.transport.pull = seen  # type: ignore[method-assign]
    got = _pull(client, slices, names=["s", "v"], dtype=torch.bfloat16)
    served = _pulled_bytes(client) - before
    client.close()
    assert {r.chunk.name for r in answers} == {"z", "s", "v"}
    assert all(not r.chunk.data and r.chunk.shm_bytes for r in answers)
    assert torch.equal(got["z"], values["z"][:, 2:].to(torch.bfloat16))
    for n in ("s", "v"):
        assert torch.equal(got[n], values[n].to(torch.bfloat16)), n
    assert served == (5 + 1 + 7) * 2


def test_a_slice_follows_the_steps(registered) -> None:
    """After a push, the slice is of the new weights (the shard waits for min_version as any Pull)."""
    client, values = registered
    grads = {n: torch.ones_like(t) for n, t in values.items()}
    client.push(grads, step=0)
    mins = list(client.versions)
    sl = TensorSlice(1, 2, 1)
    got = PullInFlight(client, ["w"], slices={"w": sl}, min_versions=[m + 1 for m in mins]).start().result()["w"]
    assert torch.equal(got, _expected(values["w"] - 0.1, sl))


BAD = [
    (ps_pb2.TensorSlice(name="w", dim=2, parts=2, index=0), "dim must be in [0, 2) for shape [10, 6], got 2"),
    (ps_pb2.TensorSlice(name="w", dim=-1, parts=2, index=0), "dim must be in [0, 2) for shape [10, 6], got -1"),
    (ps_pb2.TensorSlice(name="w", dim=0, parts=2, index=2), "index must be in [0, 2) for parts 2, got 2"),
    (ps_pb2.TensorSlice(name="w", dim=0, parts=2, index=-1), "index must be in [0, 2) for parts 2, got -1"),
    (ps_pb2.TensorSlice(name="w", dim=0, parts=0, index=0), "parts must be >= 1, got 0"),
    (ps_pb2.TensorSlice(name="w", dim=1, parts=2, index=0, blocks=4),
     "blocks must be >= 1 and divide dimension 1 (size 6) into equal blocks, got 4"),
    (ps_pb2.TensorSlice(name="s", dim=0, parts=1, index=0), "a tensor of shape [] has no dimension to slice"),
]


def _raw_pull(client: shardps.PSClient, shard: int, req: ps_pb2.PullRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info, FrameStub(client.transport.addresses[shard]) as stub:
        stub.Pull(req, timeout=10)
    return info.value


@pytest.mark.parametrize(("bad", "says"), BAD)
def test_bad_slices_are_invalid_argument_and_change_nothing(registered, bad: ps_pb2.TensorSlice, says: str) -> None:
    client, values = registered
    shard = next(p.server for p in client.shard_map.parts_of(bad.name))
    before = client.stats()[shard]
    err = _raw_pull(client, shard, ps_pb2.PullRequest(worker_id=0, slices=[bad]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {bad.name!r}" in err.details() and says in err.details(), err.details()
    after = client.stats()[shard]
    assert (after["pull_bytes_total"], after["version"]) == (before["pull_bytes_total"], before["version"])
    assert torch.equal(client.pull(["w"])["w"], values["w"])


def test_a_tensor_named_twice_a_bad_segment_and_an_unknown_tensor_are_refused(registered) -> None:
    client, _ = registered
    w = ps_pb2.TensorSlice(name="w", dim=0, parts=2, index=0)
    err = _raw_pull(client, 0, ps_pb2.PullRequest(worker_id=0, names=["w"], slices=[w]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'w' is asked for more than once" in err.details()
    err = _raw_pull(client, 0, ps_pb2.PullRequest(worker_id=0, slices=[w, w]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'w' is asked for more than once" in err.details()
    err = _raw_pull(client, 0, ps_pb2.PullRequest(worker_id=0, slices=[w], shm="seg"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "segment name 'seg'" in err.details()
    before = client.stats()[0]
    # the frame's pull buffer (none here: 0 bytes) too small for the slice: refused before anything is counted
    err = _raw_pull(client, 0, ps_pb2.PullRequest(worker_id=0, slices=[w], shm=FRAME_SEGMENT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert f"segment {FRAME_SEGMENT} holds 0 bytes; the slices asked need" in err.details(), err.details()
    after = client.stats()[0]
    assert after["pull_bytes_total"] == before["pull_bytes_total"]
    err = _raw_pull(client, 0, ps_pb2.PullRequest(worker_id=0, slices=[ps_pb2.TensorSlice(name="nope", parts=1)]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.details()
