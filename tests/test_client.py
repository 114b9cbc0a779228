"""PSClient driven by hand: push, pull, stats, and its client-side checks."""

import pytest
import torch

import shardps


def test_push_pull_stats_by_hand(cluster2):
    w = torch.arange(600, dtype=torch.float32).view(20, 30)
    with shardps.connect(cluster2.addresses, worker_id=0, num_workers=1, part_bytes=512) as client:
        client.register({"w": w, "v": torch.zeros(7)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        results = client.push({"w": torch.ones(20, 30)}, step=0)  # "v" has no gradient this step
        assert [r.applied for r in results] == [True, True]
        out = client.pull(["w"], min_versions=[1, 1])
        assert torch.equal(out["w"], w - 1)
        # Into a non-contiguous target (the path device tensors take: staging, then copy_).
        target = torch.zeros(30, 20).t()
        client.pull(["w"], out={"w": target})
        assert torch.equal(target, w - 1)
        stats = client.stats()
        assert [s["version"] for s in stats] == [1, 1]
        assert sum(t["weight_bytes"] for s in stats for t in s["tensors"]) == (600 + 7) * 4
        assert sum(s["push_bytes_total"] for s in stats) == 600 * 4
        assert all(s["registered_workers"] == [0] for s in stats)

        with pytest.raises(KeyError, match="unknown tensors \\['nope'\\]"):
            client.push({"nope": torch.ones(1)}, step=1)
        with pytest.raises(ValueError, match="expected shape \\(20, 30\\), got \\(30, 20\\)"):
            client.push({"w": torch.ones(30, 20)}, step=1)


def test_attach_learns_the_layout_and_connects_beside_a_worker_of_the_same_id(cluster2):
    """A pull-only client asks each shard where its data connection goes (Workers.Connect); under the worker's
    own id (0 for both here) its connection stands beside the worker's, which goes on serving."""
    w = torch.randn(64, 16)
    with shardps.connect(cluster2.addresses, part_bytes=1024, shm=False) as owner:
        owner.register({"w": w}, shardps.optim.SGD(lr=1.0), sync="asp")
        conns = [p.conn for p in owner.paths]
        with shardps.connect(cluster2.addresses, shm=False) as reader:
            reader.attach()
            assert reader.shard_map.parts == owner.shard_map.parts
            assert torch.equal(reader.pull()["w"], w)
            assert reader.worker_id == owner.worker_id and {p.conn for p in reader.paths}.isdisjoint(conns)
            owner.push({"w": torch.ones(64, 16)}, step=0)
            assert torch.equal(reader.pull(min_versions=1)["w"], w - 1)
            assert [p.conn for p in owner.paths] == conns and not any(c.error for c in conns)


@pytest.mark.cluster
def test_connect_times_out_with_the_address():
    with pytest.raises(TimeoutError, match="127.0.0.1:1"):
        shardps.connect(["127.0.0.1:1"], ready_timeout=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parameters_round_trip(cluster2):
    model = torch.nn.Linear(32, 8).cuda()
    with shardps.connect(cluster2.addresses) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(torch.randn(4, 32, device="cuda")).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        for n, p in model.named_parameters():
            assert p.device.type == "cuda"
            torch.testing.assert_close(p.detach(), before[n] - 0.1 * grads[n])
