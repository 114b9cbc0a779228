"""Row tables under kill -9 of a server process (--replicas 2): the backup takes the shard over, the workers
follow it, and the table and the dense weights end as in a run without the fault, bit for bit. A row request
to a shard that is down fails over to the backup the client learnt when it registered the table.

The in-process failover of a row table is in tests/test_rows_server.py; the dense tensors under kill -9 in
tests/test_replication_kill.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardps
from shardps.optim import SGD, SparseAdam
from shardps.protos.rows import as_u64, shard_of
from tests.helpers import run_workers

WORKERS = 2
IDS = 40  # the table's rows: both shards hold some
STEPS = 14
KILL_AFTER = 5  # worker 0's step 5 acknowledged: then server 1 (shard 1's primary) is killed


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = shardps.nn.Embedding(IDS, 4, optimizer=SparseAdam(lr=0.05))
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + k)
    ids = torch.randint(0, IDS, (6,), generator=g)
    ids[1] = ids[0]  # a repeated id: its gradients are summed
    return ids, torch.randn(6, generator=g)


OnStep = Callable[[int, int], None]


def train(addresses: list[str], on_step: OnStep | None = None) -> list[tuple[torch.Tensor, dict, int]]:
    """WORKERS workers in threads, bsp, over real gRPC: each returns (every row of the table as it pulls
    them at the end, its dense parameters, its failovers)."""
    models = [Model() for _ in range(WORKERS)]  # built here: Model seeds torch's global generator

    def worker(k: int) -> tuple[torch.Tensor, dict, int]:
        model = models[k]
        with shardps.connect(addresses, worker_id=k, num_workers=WORKERS, timeout=60,
                             recovery_timeout=60) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=SGD(lr=0.1), sync="bsp")
            for step in range(STEPS):
                ids, y = batch(step, k)
                F.mse_loss(model(ids), y).backward()
                opt.step()  # acknowledged: the rows' and the dense push of this step are applied
                opt.zero_grad()
                if on_step is not None:
                    on_step(k, step)
            rows = client.rows.pull("emb", torch.arange(IDS), track=False)
            return rows, {n: p.detach().clone() for n, p in model.named_parameters()}, client.failovers_total

    return run_workers(worker, WORKERS, timeout=240)


@pytest.mark.cluster
@pytest.mark.fault
@pytest.mark.timeout(300)
def test_kill_9_of_a_row_tables_primary_and_the_rows_are_exact(make_cluster):
    """SparseAdam rows and an SGD dense head, bsp over 2 workers: server 1 is SIGKILLed once worker 0's
    step KILL_AFTER is acknowledged (worker 1 may be anywhere in its step KILL_AFTER + 1 then: held at the
    rows' barrier, mid-push, pulling). Both workers fail over to shard 1's backup and finish; every row and
    every dense weight equals the run without the kill, bit for bit, and both shards counted every step."""
    assert set(shard_of(as_u64(torch.arange(IDS)), 2).tolist()) == {0, 1}
    clean = train(make_cluster(2).addresses)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        killed: list[int] = []

        def on_step(k: int, step: int) -> None:
            if k == 0 and step == KILL_AFTER:
                c.kill(1)
                killed.append(step)

        got = train(c.addresses, on_step)
        assert killed == [KILL_AFTER]
        with shardps.connect(c.serving_addresses()) as client:
            stats = client.stats()
    for (want_rows, want, _), (rows, weights, failovers) in zip(clean, got):
        assert failovers == 1
        assert torch.equal(rows, want_rows)
        for n in want:
            assert torch.equal(weights[n], want[n]), n
    assert stats[1]["role"] == "primary"  # server 0's backup of shard 1, promoted
    assert [s["row_tables"][0]["steps"] for s in stats] == [STEPS, STEPS]
    assert [s["version"] for s in stats] == [STEPS, STEPS]



@pytest.mark.cluster
@pytest.mark.fault
@pytest.mark.timeout(120)
def test_a_row_request_while_its_shard_is_down_fails_over():
    """--replicas 2, clients of the row table alone, server 1 SIGKILLed: a client that learnt the backups
    from register_rows (no other call) fails over and reads the rows as they were, as one that also called
    attach() does. (A client with no backup to go to fails naming the table: tests/test_rows_server.py.)"""
    keys = torch.arange(IDS)
    with shardps.LocalCluster(2, processes=True, replicas=2) as c:
        with shardps.connect(c.addresses, timeout=10, recovery_timeout=1) as alone, \
                shardps.connect(c.addresses, timeout=10, recovery_timeout=1) as attached:
            for client in (alone, attached):
                client.rows.register("emb", 4, optimizer=SparseAdam(lr=0.05), seed=3)
            attached.attach()
            assert alone.backups == attached.backups == c.backup_addresses
            alone.rows.push("emb", keys[::3], torch.ones(len(keys[::3]), 4), 0)  # pushed rows: replicated
            before = alone.rows.pull("emb", keys, track=False)  # the others: created by this pull alone
            c.kill(1)
            for client in (alone, attached):
                assert torch.equal(client.rows.pull("emb", keys), before)
                assert client.transport.failovers_total == 1
            attached.rows.push("emb", keys[:4], torch.ones(4, 4), 1)  # and the table goes on on the backup
