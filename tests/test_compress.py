"""Compressed pushes against real shards on loopback: exact where it can be, refused when malformed, measured.

The worker's side alone (error feedback's sums, the parts, the chunks) is
tests/worker/test_compress.py; the encodings' checks tests/protos/test_compressed.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

import shardps
from shardps.compress import Dense, PowerSGD, Rules, TopK
from shardps.protos import compressed
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.frames import FrameStub
from tests.helpers import run_workers

PATHS = [pytest.param(False, id="grpc"), pytest.param(True, id="shm")]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 5))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 24, generator=g), torch.randint(0, 5, (16,), generator=g)


def train(cluster: shardps.LocalCluster, compress, *, shm: bool, sync: str = "bsp", steps: int = 6) -> dict:
    model = make_model()
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=1024, shm=shm) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync,
                                           compress=compress)
        for step in range(steps):
            x, y = batch(step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert all(link is not None for link in client.shm_links) == shm  # the path the test asked for
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shm", PATHS)
@pytest.mark.parametrize("sync", ["bsp", "asp"])  # asp: fp32 chunks kept as received (fused Adam) beside others
def test_topk_at_ratio_one_equals_no_compression_bit_for_bit(make_cluster, shm, sync):
    dense = train(make_cluster(2), None, shm=shm, sync=sync)
    every = Rules([], default=TopK(1.0))  # every tensor, biases too, through the compressed path
    topk = train(make_cluster(2), every, shm=shm, sync=sync)
    for name, w in dense.items():
        assert torch.equal(topk[name], w), name


def test_bsp_two_workers_each_compressed_gradient_applied_exactly_once(make_cluster):
    # Integer gradients, SGD at lr 1: every sum and mean is exact in fp32, so the shards' weights must equal,
    # bit for bit, the start minus each step's mean of what the two workers sent (as the worker expanded it).
    cluster = make_cluster(2)
    steps, shapes = 5, {"w": (48, 32), "v": (30, 40)}

    def worker(k: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        params = {n: nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
        client = shardps.connect(cluster.addresses, worker_id=k, num_workers=2, part_bytes=2048)
        opt = shardps.DistributedOptimizer(params.items(), client, optimizer=shardps.optim.SGD(lr=1.0),
                                           compress=TopK(0.05))
        assert opt.compressor is not None
        opt.compressor.keep_sent = True
        sent = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * k + step)
            for p in params.values():
                p.grad = torch.randint(-50, 50, p.shape, generator=g).float()
            opt.step()
            sent.append({n: t.clone() for n, t in opt.compressor.sent.items()})
        client.close()
        return {n: p.detach().clone() for n, p in params.items()}, sent

    (w0, sent0), (w1, sent1) = run_workers(worker, 2)
    for name, shape in shapes.items():
        want = torch.zeros(shape).reshape(-1)
        for a, b in zip(sent0, sent1):
            want -= (a[name] + b[name]) / 2
        assert torch.equal(w0[name].reshape(-1), want) and torch.equal(w1[name].reshape(-1), want), name
    for st in cluster.stores:
        assert st.job.version == steps and st.applier.gradients_applied_total == 2 * steps


@pytest.mark.parametrize("shm", PATHS)
def test_powersgd_the_shards_reconstruct_what_the_worker_sent(make_cluster, shm):
    cluster = make_cluster(2)
    params = {"w": nn.Parameter(torch.zeros(96, 40)), "b": nn.Parameter(torch.zeros(40))}
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, part_bytes=4096, shm=shm) as client:
        opt = shardps.DistributedOptimizer(params.items(), client, optimizer=shardps.optim.SGD(lr=1.0),
                                           compress=PowerSGD(rank=3))
        assert opt.compressor is not None and set(opt.compressor.specs) == {"w"}  # the bias stays dense
        opt.compressor.keep_sent = True
        total = torch.zeros(96 * 40)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            params["w"].grad = torch.randn(96, 40, generator=g)
            params["b"].grad = torch.randn(40, generator=g)
            opt.step()
            total -= opt.compressor.sent["w"]
        # The shards computed P Q^T from the bytes they received with the worker's own function: the same bits.
        torch.testing.assert_close(params["w"].detach().reshape(-1), total, rtol=0, atol=1e-6)
        assert len({p.server for p in client.shard_map.parts_of("w")}) == 2  # both shards held rows of w


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _topk(idx, numel=20, **more) -> ps_pb2.Chunk:
    fields = dict(name="w", offset=0, dtype=ps_pb2.FLOAT32, encoding=compressed.TOPK, numel=numel, shape=[4, 5],
                  indices=_bytes(torch.tensor(idx, dtype=torch.int32)), data=_bytes(torch.ones(len(idx))))
    fields.update(more)
    return ps_pb2.Chunk(**fields)


def _lowrank(rows=4, rank=2, q_rows=5, **more) -> ps_pb2.Chunk:
    fields = dict(name="w", offset=0, dtype=ps_pb2.FLOAT32, encoding=compressed.LOWRANK, numel=rows * 5, rank=rank,
                  data=_bytes(torch.ones(rows, rank)), factor=_bytes(torch.ones(q_rows, rank)))
    fields.update(more)
    return ps_pb2.Chunk(**fields)


BAD = {
    "duplicate index": ([_topk([1, 4, 4])], ["'w'", "strictly ascending", "got 4 after 4"]),
    "index out of range": ([_topk([1, 4, 20])], ["'w'", "indices expected in [0, 20)", "got [1, 20]"]),
    "indices size": ([_topk([1, 4], indices=b"\0" * 4)], ["'w'", "indices expected 8 bytes", "got 4"]),
    "wrong dtype": ([_topk([1], dtype=ps_pb2.BFLOAT16, data=b"\0\0")], ["'w'", "expected float32", "got bfloat16"]),
    "range past the part": ([_topk([1], numel=25)], ["'w'", "[0, 25) is out of range", "20 elements"]),
    "part not covered": ([_topk([1], numel=15)], ["'w'", "covers 15 of the 20 elements"]),
    "overlap with a dense chunk": ([_topk([1]), ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32,
                                                             data=_bytes(torch.ones(20)))], ["'w'", "overlapping"]),
    "lowrank Q size": ([_lowrank(q_rows=4)], ["'w'", "factor (Q) expected 5 x 2 elements", "got 8"]),
    "lowrank rows": ([_lowrank(numel=18)], ["'w'", "[0, 18) is not whole rows of 5 elements"]),
    "lowrank of a vector": ([_lowrank(name="b", numel=5, rows=1, q_rows=1)], ["'b'", "has no matrix view"]),
    "unknown encoding": ([_topk([1], encoding=9)], ["'w'", "<unknown encoding 9>"]),
}


@pytest.fixture
def one_shard(make_cluster):
    cluster = make_cluster(1)
    client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
    client.register({"w": torch.randn(4, 5), "b": torch.randn(5)}, shardps.optim.SGD(lr=1.0), sync="bsp")
    stub = FrameStub(cluster.addresses[0])  # Push as a data connection's frames
    yield cluster.stores[0], stub, client
    stub.close()
    client.close()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_compressed_push_is_refused_and_changes_nothing(one_shard, case):
    store, stub, _ = one_shard
    chunks, fragments = BAD[case]
    before, pushes = store.state_hash(), store.job.pushes_total
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([ps_pb2.PushRequest(worker_id=0, step=0, chunk=c) for c in chunks]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())
    assert store.state_hash() == before and store.job.pushes_total == pushes
    # ... and a good compressed push goes in after it: 0 but w[1] = 1 - 1 (SGD at lr 1 from the values).
    w = store.reader.weights("w")[0].reshape(-1).clone()
    stub.Push(iter([ps_pb2.PushRequest(worker_id=0, step=0, chunk=_topk([1]))]), timeout=10)
    w[1] -= 1.0
    assert store.job.version == 1 and torch.equal(store.reader.weights("w")[0].reshape(-1), w)


def test_compressed_initial_values_and_shared_memory_ranges_are_refused(one_shard):
    store, stub, _ = one_shard
    before = store.state_hash()
    seg = ps_pb2.PushRequest(worker_id=0, step=0, shm="shardps-nope", chunk=_topk([1], shm_offset=0, shm_bytes=4))
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([seg]), timeout=10)
    assert "'w'" in err.value.details() and "compressed chunks carry their bytes" in err.value.details()
    spec = ps_pb2.TensorSpec(name="z", shape=[4, 5], dtype=ps_pb2.FLOAT32, parts=[ps_pb2.Part(start=0, stop=20)],
                             optimizer=ps_pb2.OptimizerSpec(name="sgd", params_json="{}"))
    reg = ps_pb2.RegisterRequest(worker_id=0, num_workers=1, sync="bsp", tensors=[spec], provides_values=True,
                                 chunk=_topk([1], name="z"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(iter([reg]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'z'" in err.value.details() and "initial value encoding expected dense, got topk" in err.value.details()
    assert store.state_hash() == before


def test_topk_one_percent_pushes_two_percent_of_the_bytes_measured_by_the_shards(make_cluster):
    def received(compress) -> tuple[int, int]:
        cluster = make_cluster(2)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
        with shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), compress=compress)
            start = [s["push_received_bytes_total"] for s in client.stats()]
            for _ in range(3):
                model(torch.randn(8, 256)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            stats = client.stats()
        return (sum(s["push_received_bytes_total"] for s in stats) - sum(start),
                sum(s["push_bytes_total"] for s in stats))

    dense, topk = received(None), received(TopK(0.01))
    assert dense[1] == 3 * 2 * 256 * 256 * 4 and dense[0] > dense[1]  # the payload, and the messages around it
    values = 3 * 2 * 656 * (4 + 4)  # 656 values of each 256 x 256 a push, and their int32 indices
    assert topk[1] == values
    ratio = topk[0] / dense[0]
    assert 0.019 < ratio < 0.025, (dense, topk, ratio)  # 8 bytes per value sent of 100: 2 %, and the headers


def test_compress_refuses_what_it_does_not_support(cluster2):
    with shardps.connect(cluster2.addresses) as client:
        with pytest.raises(ValueError, match="compress= with overlap=True is not supported"):
            shardps.DistributedOptimizer(make_model(), client, compress=TopK(0.1), overlap=True)
        with pytest.raises(ValueError, match="compress= with loss_scaling is not supported"):
            shardps.DistributedOptimizer(make_model(), client, compress=TopK(0.1), loss_scaling=True)
        opt = shardps.DistributedOptimizer(make_model(), client, compress=Rules([], default=Dense()))
        assert opt.compressor is not None and not opt.compressor.specs  # nothing compressed: every push dense
