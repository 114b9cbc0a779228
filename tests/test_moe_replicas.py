"""Mixture of experts under --replicas 2: the gradients a step's held backwards leave on a shard
(server/experts/heldgrads.py) outlive its primary, reach a backup that joins mid-step, and stay out of checkpoints.

Real servers in this process on loopback ports (LocalCluster); faults at exact points (a primary stopped,
a backup attached, between a step's two backwards).
"""

from __future__ import annotations

import numpy as np
import torch

import shardps
from shardps.optim import SGD
from tests.test_moe import D, E, expert


def test_held_expert_gradients_survive_their_primary(make_cluster):
    """--replicas 2, "send" with ``hold`` (a pipeline stage's micro-batches): shard 0's primary stops once the
    step's first backward has held its experts' gradients there and been answered. The second backward and
    the step's push go to the backup, which holds the first backward's gradients too (replicated before
    the answer: server/experts/heldgrads.py), so every expert's row equals the same step without the stop, bit for
    bit. Without the replication the backup pushes the second backward's alone and the rows differ."""
    rows = []
    for stop in (False, True):
        cluster = make_cluster(2, replicas=2)
        torch.manual_seed(0)
        moe = shardps.nn.MoE(D, E, expert, name="kept", placement="send", drop_tokens=False, optimizer=SGD(lr=0.1))
        moe.experts.hold = True
        xs = [torch.randn(16, D) for _ in range(2)]
        with shardps.connect(cluster.addresses, timeout=60) as client:
            opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.1))
            before = client.pull_rows("kept", torch.arange(E), track=False)
            for i, x in enumerate(xs):
                if stop and i == 1:
                    cluster.stop_server(1)  # shard 0's primary goes away between the two backwards
                out, aux, _ = moe(x)
                (out.sum() + aux).backward()
            opt.step()
            opt.zero_grad()
            rows.append(client.pull_rows("kept", torch.arange(E), track=False))
            assert client.transport.failovers_total == (1 if stop else 0)
    moved = (rows[0] != before).any(dim=1)
    assert moved.sum() >= 2 and torch.equal(rows[0], rows[1])


def test_a_backup_that_joins_mid_step_gets_the_held_gradients(make_cluster):
    """--replicas 2 with shard 0's backup gone: the step's first backward holds its experts' gradients on the
    primary alone. A fresh backup then joins (``attach-replica``: a snapshot syncs it) and the primary
    stops; the second backward and the step's push go to the new backup, which got the held gradients in
    the snapshot (server/experts/heldgrads.py ``state``), so every expert's row equals the same step without any of
    this, bit for bit. Without them in the snapshot the backup pushes the second backward's alone."""
    import io

    from shardps.admin import run_attach_replica
    from shardps.protos.shardps.v1 import ps_pb2
    from shardps.server.service import create_server, stop_server
    from shardps.server.store import ShardStore

    rows, servers = [], []
    try:
        for join in (False, True):
            cluster = make_cluster(2, replicas=2)
            if join:
                cluster.stop_server(2)  # shard 0's backup goes away before the job starts
            torch.manual_seed(0)
            moe = shardps.nn.MoE(D, E, expert, name="joined", placement="send", drop_tokens=False,
                                 optimizer=SGD(lr=0.1))
            moe.experts.hold = True
            xs = [torch.randn(16, D) for _ in range(2)]
            with shardps.connect(cluster.addresses, timeout=60) as client:
                opt = shardps.DistributedOptimizer(moe, client, optimizer=SGD(lr=0.1))
                before = client.pull_rows("joined", torch.arange(E), track=False)
                for i, x in enumerate(xs):
                    if join and i == 1:
                        fresh = ShardStore(0, 2, role="backup")
                        server, port = create_server(fresh)
                        servers.append(server)
                        assert run_attach_replica(cluster.addresses, 0, f"127.0.0.1:{port}", out=io.StringIO()) == 0
                        e = moe.experts
                        assert fresh.rows.held.holds("joined", e.rows.worker_id, e.sent_step)
                        t = client.transport  # what the worker's heartbeat learns: the shard's backup now
                        t.set_backup(0, t.stub(0).Describe(ps_pb2.StatsRequest(), timeout=30).backup, t.stub(0))
                        cluster.stop_server(1)  # shard 0's primary goes away
                    out, aux, _ = moe(x)
                    (out.sum() + aux).backward()
                opt.step()
                opt.zero_grad()
                rows.append(client.pull_rows("joined", torch.arange(E), track=False))
                assert client.transport.failovers_total == (1 if join else 0)
    finally:
        for server in servers:
            stop_server(server)
    moved = (rows[0] != before).any(dim=1)
    assert moved.sum() >= 2 and torch.equal(rows[0], rows[1])


def test_a_checkpoint_leaves_held_gradients_out_and_a_backups_sync_carries_them():
    """``snapshot()`` (what a checkpoint writes) has no holds: a step redone after a rollback holds anew.
    ``snapshot_locked(holds=True)`` (a backup's sync) has them, and a restore from it holds the same."""
    from shardps.protos.rows import RowTableSpec
    from shardps.server.store import ShardStore

    a, b = ShardStore(0, 1), ShardStore(0, 1, role="backup")
    a.rows.register(RowTableSpec("x", 3, SGD(lr=0.1)))
    keys = np.array([7, 2**64 - 2], dtype=np.uint64)
    a.rows.hold("x", 3, 1, 5, 0, keys, torch.ones(2, 3), np.array([4, -1]))
    a.rows.hold("x", 3, 1, 5, 1, keys[:1], 2 * torch.ones(1, 3))
    assert "row_holds" not in a.snapshot()[1]
    with a._cond:
        version, meta, tensors = a.snapshot_locked(holds=True)
    b.restore(version, meta, tensors)
    none = np.zeros(0, dtype=np.int64)
    got = [s.rows.held.with_held("x", 1, 5, keys[:0], torch.zeros(0, 3), none) for s in (a, b)]
    assert got[1][0].tolist() == [7, 2**64 - 2, 7] and got[1][2].tolist() == [4, -1, -1]
    assert all(torch.equal(x, y) for x, y in zip(got[0][1:2], got[1][1:2]))
    assert b.rows.held.data[("x", 1)][1] == {0, 1}  # the indexes held: a retry is not held again


def test_a_hold_sent_twice_is_held_once_and_every_hold_reaches_the_backup():
    """A Backward with hold that comes again (its answer lost, or sent again to the backup that took over)
    names the same ``hold_index``: held once, recorded once; the backup's replay holds what the primary
    holds."""
    from shardps.protos.rows import RowTableSpec
    from shardps.server.rows.tables import RowTables

    log: list = []
    primary = RowTables(record=lambda args, tensors: log.append((args, tensors)), recording=lambda: True)
    backup = RowTables()
    primary.register(RowTableSpec("x", 3, SGD(lr=0.1)))
    keys, g = np.array([5, 2**64 - 1], dtype=np.uint64), torch.ones(2, 3)
    primary.hold("x", 3, 0, 4, 0, keys, g)
    primary.hold("x", 3, 0, 4, 0, keys, g)  # the same hold again
    primary.hold("x", 3, 0, 4, 1, keys, 2 * g)
    for args, tensors in log:
        backup.replay(args, tensors)
    assert [a["op"] for a, _ in log] == ["register", "hold", "hold"]
    none = np.zeros(0, dtype=np.int64)
    for tables in (primary, backup):
        k, got, _ = tables.held.with_held("x", 0, 4, keys[:0], g[:0], none)
        assert k.tolist() == [5, 2**64 - 1] * 2 and torch.equal(got, torch.cat([g, 2 * g]))
        assert len(tables.held.with_held("x", 0, 5, keys[:0], g[:0], none)[0]) == 0  # another step: none
    primary.held.drop("x", 0, 4)
    assert len(primary.held.with_held("x", 0, 4, keys[:0], g[:0], none)[0]) == 0
