"""Row tables through real servers: keys, init, chunking, bad input, sparse optimizers against references."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import shardps
from shardps.deploy.local import read_ready
from shardps.protos.optim import SGD, RowwiseAdagrad, SparseAdam
from shardps.protos.rows import RowTableSpec, init_rows
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.metrics import StoreCollector
from tests.helpers import shardps_process

EDGE_KEYS = torch.tensor([0, -1, 7, 7, 2**63 - 1, -(2**63), 0], dtype=torch.int64)  # -1 is 2**64-1 on the wire


def test_pull_creates_rows_with_an_init_of_key_alone(make_cluster):
    """Rows start as a function of (seed, name, key): the same on 1 or 3 servers, in any order."""
    got = []
    for n in (1, 3):
        cluster = make_cluster(n)
        with shardps.connect(cluster.addresses) as client:
            client.rows.register("emb", 8, init={"kind": "normal", "mean": 0.0, "std": 1.0}, seed=3)
            got.append(client.rows.pull("emb", EDGE_KEYS.flip(0)).flip(0))
            assert client.rows.pull("emb", EDGE_KEYS.view(7, 1)).shape == (7, 1, 8)
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0][0], got[0][6]) and torch.equal(got[0][2], got[0][3])
    assert not torch.equal(got[0][0], got[0][1])
    # Roughly normal(0, 1) over many keys.
    rows = init_rows(RowTableSpec("t", 64, SGD(lr=0.1), seed=1), np.arange(2000, dtype=np.uint64))
    assert abs(float(rows.mean())) < 0.02 and abs(float(rows.std()) - 1) < 0.02


def test_push_sums_repeated_keys_and_chunks(make_cluster):
    """Repeated keys' gradients are summed; a request larger than a message is chunked both ways."""
    cluster = make_cluster(2, chunk_bytes=4096)
    with shardps.connect(cluster.addresses, chunk_bytes=4096) as client:
        client.rows.register("t", 16, optimizer=SGD(lr=0.5), init={"kind": "zeros"})
        keys = torch.arange(3000, dtype=torch.int64).repeat(2)  # 6000 keys, 3000 distinct, 3 x 64 B/message
        assert client.rows.push("t", keys, torch.ones(6000, 16), step=0) == 3000
        rows = client.rows.pull("t", torch.arange(3000))
        assert torch.equal(rows, torch.full((3000, 16), -1.0))  # 0 - 0.5 * (1 + 1)
        held = sum(s.rows.stats()["t"]["rows"] for s in cluster.stores)
        assert held == 3000
        # Only the distinct rows crossed the wire: keys (8 B), rows (64 B) and versions (8 B) of 3000 rows, each
        # way once.
        assert client.rows.wire_bytes == 2 * 3000 * (8 + 64 + 8)


def _abort_of(call):
    with pytest.raises(grpc.RpcError) as e:
        r = call()
        if hasattr(r, "__next__"):
            list(r)
    return e.value.code(), e.value.details()


def test_bad_row_requests_name_the_table_and_change_nothing(make_cluster):
    cluster = make_cluster(1)
    store = cluster.stores[0]
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("emb", 4, optimizer=SparseAdam())
        client.rows.pull("emb", torch.tensor([1, 2]))
        before = (store.rows.stats(), store.rows.tables["emb"].weights[:2].clone())
        channel = grpc.insecure_channel(cluster.addresses[0])
        stub = ps_pb2_grpc.RowsStub(channel)
        keys = np.array([1, 2, 3], dtype="<u8").tobytes()
        grads = np.ones(12, dtype="<f4").tobytes()

        def push(**kw):
            msg = dict(table="emb", key_dtype="uint64", keys=keys, grads=grads, dim=4) | kw
            return stub.PushRows(iter([ps_pb2.PushRowsRequest(**msg)]), timeout=10)

        cases = {
            "wrong dim": (lambda: push(dim=3, grads=np.ones(9, dtype="<f4").tobytes()),
                          grpc.StatusCode.INVALID_ARGUMENT, ["'emb'", "expected dim 4", "got 3"]),
            "unknown table": (lambda: push(table="nope"), grpc.StatusCode.NOT_FOUND, ["'nope'"]),
            "float keys": (lambda: push(key_dtype="float64"), grpc.StatusCode.INVALID_ARGUMENT,
                           ["'emb'", "int64", "got 'float64'"]),
            "ragged keys": (lambda: push(keys=keys[:-1]), grpc.StatusCode.INVALID_ARGUMENT, ["'emb'", "23 bytes"]),
            "short grads": (lambda: push(grads=grads[:-4]), grpc.StatusCode.INVALID_ARGUMENT,
                            ["'emb'", "48 bytes", "got 44"]),
            "repeated pull keys": (lambda: stub.PullRows(ps_pb2.PullRowsRequest(
                table="emb", key_dtype="uint64", keys=keys + keys[:8], dim=4), timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT, ["'emb'", "expected distinct keys", "got 1 repeated"]),
            "pull wrong dim": (lambda: stub.PullRows(ps_pb2.PullRowsRequest(table="emb", key_dtype="uint64", keys=keys,
                                                                            dim=5), timeout=10),
                               grpc.StatusCode.INVALID_ARGUMENT, ["'emb'", "expected dim 4", "got 5"]),
            "other spec": (lambda: stub.RegisterRows(ps_pb2.RegisterRowsRequest(
                table=RowTableSpec("emb", 4, SGD(lr=1.0)).to_proto()), timeout=10),
                grpc.StatusCode.FAILED_PRECONDITION, ["'emb'", "registered as"]),
            "unsupported hyper-parameter": (lambda: stub.RegisterRows(ps_pb2.RegisterRowsRequest(
                table=ps_pb2.RowTableSpec(name="x", dim=4, keys="int64", optimizer=ps_pb2.OptimizerSpec(
                    name="sparse_adam", params_json='{"weight_decay": 0.1}'))), timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT, ["weight_decay"]),
        }
        for what, (call, code, words) in cases.items():
            got_code, details = _abort_of(call)
            assert got_code == code, (what, details)
            for w in words:
                assert w in details, (what, details)
        assert store.rows.stats() == before[0] and "x" not in store.rows.tables
        assert torch.equal(store.rows.tables["emb"].weights[:2], before[1])
        channel.close()
        with pytest.raises(ValueError, match="momentum"):
            client.rows.register("m", 4, optimizer=SGD(lr=0.1, momentum=0.9))


def test_sparse_adam_equals_torch(make_cluster):
    """200 steps with repeated ids, through 2 servers, against nn.Embedding(sparse=True) + torch SparseAdam:
    touched rows within 1e-6; rows never touched, and their moments, bit-identical."""
    n, dim = 64, 8
    cluster = make_cluster(2)
    gen = torch.Generator().manual_seed(0)
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("emb", dim, optimizer=SparseAdam(lr=0.01, betas=(0.8, 0.9), eps=1e-6), seed=5)
        ref = torch.nn.Embedding(n, dim, sparse=True)
        with torch.no_grad():
            ref.weight.copy_(client.rows.pull("emb", torch.arange(n)))
        opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, betas=(0.8, 0.9), eps=1e-6)
        target = torch.randn(dim, generator=gen)
        for step in range(200):
            ids = torch.randint(0, n // 2, (12,), generator=gen)  # rows >= n / 2 are never touched
            ids[1] = ids[0]
            # The gradient of the rows as torch holds them (the servers' agree: checked at the end).
            rows = ref.weight.detach()[ids].requires_grad_()
            ((rows - target) ** 2).sum().backward()
            client.rows.push("emb", ids, rows.grad, step)
            opt.zero_grad()
            ((ref(ids) - target) ** 2).sum().backward()
            opt.step()
        got = client.rows.pull("emb", torch.arange(n))
    assert torch.allclose(got[: n // 2], ref.weight.detach()[: n // 2], atol=1e-6, rtol=0)
    assert torch.equal(got[n // 2:], ref.weight.detach()[n // 2:])
    st = opt.state[ref.weight]
    for store in cluster.stores:
        t = store.rows.tables["emb"]
        assert t.steps == 200
        keys = np.array(list(t.slots), dtype=np.uint64)
        slots = torch.tensor(list(t.slots.values()))
        for k in ("exp_avg", "exp_avg_sq"):
            want = st[k].to_dense()[torch.from_numpy(keys.astype(np.int64))]
            assert torch.allclose(t.state[k][slots], want, atol=1e-6, rtol=1e-5)
            untouched = torch.from_numpy(keys >= n // 2)
            assert torch.equal(t.state[k][slots][untouched], torch.zeros_like(want[untouched]))


def test_rowwise_adagrad_equals_numpy(make_cluster):
    """FBGEMM's exact row-wise Adagrad, transcribed in NumPy: s += mean(g^2); w -= lr * g / (sqrt(s) + eps)."""
    cluster = make_cluster(2)
    rng = np.random.default_rng(0)
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("t", 6, optimizer=RowwiseAdagrad(lr=0.1, eps=1e-5), seed=9)
        w = client.rows.pull("t", torch.arange(10)).numpy().astype(np.float64)
        s = np.zeros(10)
        for step in range(20):
            ids = rng.integers(0, 10, 7)
            g = rng.standard_normal((7, 6)).astype(np.float32)
            client.rows.push("t", torch.from_numpy(ids), torch.from_numpy(g), step)
            summed = np.zeros((10, 6))
            np.add.at(summed, ids, g.astype(np.float64))
            for r in np.unique(ids):
                s[r] += np.mean(summed[r] ** 2)
                w[r] -= 0.1 * summed[r] / (np.sqrt(s[r]) + 1e-5)
        got = client.rows.pull("t", torch.arange(10)).numpy()
    assert np.allclose(got, w, atol=1e-5, rtol=0)


def _server(port: int, ckpt: Path) -> subprocess.Popen:
    proc = shardps_process("server", "--port", str(port), "--checkpoint-dir", str(ckpt))
    read_ready(proc, 60)
    return proc


@pytest.mark.fault
@pytest.mark.cluster
def test_kill_9_and_restart_restores_identical_rows(tmp_path):
    """Rows, their optimizer state and step count are in the checkpoint: a server killed with -9 and started
    again on the same checkpoint directory holds the rows it held at the checkpoint, bit for bit, and steps
    on from the step count it held."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = _server(port, tmp_path)
    try:
        keys, grads = torch.arange(-50, 50), torch.randn(4, 100, 8, generator=torch.Generator().manual_seed(0))
        with shardps.connect([f"127.0.0.1:{port}"]) as client:
            client.rows.register("emb", 8, optimizer=SparseAdam(lr=0.1))
            for step in range(2):
                client.rows.push("emb", keys, grads[step], step)
            client.checkpoint()
            saved = client.rows.pull("emb", keys)
            client.rows.push("emb", keys, grads[2], 2)  # after the checkpoint: lost with the server
            client.rows.push("emb", keys, grads[3], 3)
            want = client.rows.pull("emb", keys)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc = _server(port, tmp_path)
        with shardps.connect([f"127.0.0.1:{port}"]) as client:
            client.rows.register("emb", 8, optimizer=SparseAdam(lr=0.1))
            assert torch.equal(client.rows.pull("emb", keys), saved)
            client.rows.push("emb", keys, grads[2], 2)  # redone: the same moments and step count as before
            client.rows.push("emb", keys, grads[3], 3)
            assert torch.equal(client.rows.pull("emb", keys), want)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_admission_and_expiry_count_exactly(make_cluster):
    """admit=3: a key's first two pushes are dropped (its pulls read the init, nothing stored), the third
    creates and steps it. expire=2: a row not pushed for more than 2 of the table's steps is dropped."""
    cluster = make_cluster(1)
    store = cluster.stores[0]
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("a", 2, optimizer=SGD(lr=1.0), init={"kind": "zeros"}, admit=3)
        one = torch.ones(1, 2)
        for step in range(2):
            client.rows.push("a", torch.tensor([7]), one, step)
            assert torch.equal(client.rows.pull("a", torch.tensor([7])), torch.zeros(1, 2))
        st = store.rows.stats()["a"]
        assert (st["rows"], st["admitted"], st["dropped"], st["pending_admission"]) == (0, 0, 2, 1)
        client.rows.push("a", torch.tensor([7, 7, 8]), torch.ones(3, 2), 2)  # 7's third push (once, summed)
        assert torch.equal(client.rows.pull("a", torch.tensor([7, 8])), torch.tensor([[-2.0, -2.0], [0.0, 0.0]]))
        st = store.rows.stats()["a"]
        assert (st["rows"], st["admitted"], st["dropped"], st["pending_admission"]) == (1, 1, 3, 1)

        client.rows.register("e", 2, optimizer=SGD(lr=1.0), init={"kind": "zeros"}, expire=2)
        client.rows.push("e", torch.tensor([1, 2, 3]), torch.ones(3, 2), 0)  # step 1: rows 1, 2, 3
        client.rows.push("e", torch.tensor([2]), one, 1)  # step 2
        client.rows.push("e", torch.tensor([3]), one, 2)  # step 3
        assert store.rows.stats()["e"]["expired"] == 0
        client.rows.push("e", torch.tensor([3]), one, 3)  # step 4: row 1 (last pushed at 1) is 3 steps old
        st = store.rows.stats()["e"]
        assert (st["rows"], st["expired"]) == (2, 1)
        client.rows.push("e", torch.tensor([3]), one, 4)  # step 5: row 2 (at 2) goes too
        st = store.rows.stats()["e"]
        assert (st["rows"], st["expired"]) == (1, 2)
        rows = client.rows.pull("e", torch.tensor([1, 2, 3]))
        assert torch.equal(rows, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-4.0, -4.0]]))  # 1, 2 start again
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    sample = registry.get_sample_value
    assert sample("shardps_row_expired_total", {"shard": "0", "table": "e"}) == 2
    assert sample("shardps_row_dropped_gradients_total", {"shard": "0", "table": "a"}) == 3
    assert sample("shardps_row_table_rows", {"shard": "0", "table": "e"}) == 3


def test_a_retried_push_is_applied_once(make_cluster):
    """A push of a step its worker had applied (a retry after a lost answer) is answered and counted, not
    applied again; another worker's push of that step is its own."""
    cluster = make_cluster(1)
    with shardps.connect(cluster.addresses) as client, shardps.connect(cluster.addresses, worker_id=1,
                                                                        num_workers=2) as other:
        client.rows.register("t", 2, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        other.rows.register("t", 2, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        for _ in range(2):
            client.rows.push("t", torch.tensor([1]), torch.ones(1, 2), 0)
        other.rows.push("t", torch.tensor([1]), torch.ones(1, 2), 0)
        assert torch.equal(client.rows.pull("t", torch.tensor([1])), torch.full((1, 2), -2.0))
        st = cluster.stores[0].rows.stats()["t"]
        assert (st["steps"], st["duplicates"]) == (2, 1)


def test_row_staleness_counts_the_updates_between_pull_and_push(make_cluster):
    """Workers a and b pull rows 1 and 2; a pushes (staleness 0), then b pushes (each row was updated once
    since b pulled it: 1); a row pushed without a pull is not counted."""
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses) as a, shardps.connect(cluster.addresses, worker_id=1,
                                                                   num_workers=2) as b:
        for c in (a, b):
            c.rows.register("t", 2, optimizer=SGD(lr=1.0))
            c.rows.pull("t", torch.tensor([1, 2, 2]))
        a.rows.push("t", torch.tensor([1, 2]), torch.ones(2, 2), 0)
        b.rows.push("t", torch.tensor([2, 1, 9]), torch.ones(3, 2), 0)  # 9 was never pulled
    got = sum((s.rows.staleness() for s in cluster.stores), collections.Counter())
    assert got == {0: 2, 1: 2}
    registry = CollectorRegistry()
    for s in cluster.stores:
        registry.register(StoreCollector(s))
    assert sum(registry.get_sample_value("shardps_row_staleness_steps_sum", {"shard": str(i)}) for i in (0, 1)) == 2


def test_the_backup_replays_row_changes_to_the_same_rows(make_cluster):
    """--replicas 2: registered tables, asp and bsp steps and assigned rows reach each shard's backup before the
    push is acknowledged; the backup's rows, moments and counts equal the primary's."""
    cluster = make_cluster(2, replicas=2)
    backup_of = {b.shard_index: b for b in cluster.backups}
    keys = torch.arange(-20, 20)
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("t", 4, optimizer=SparseAdam(lr=0.1))
        for step in range(3):
            client.rows.pull("t", keys)
            client.rows.push("t", keys, torch.randn(40, 4, generator=torch.Generator().manual_seed(step)), step)
        client.rows.push("t", torch.tensor([100]), torch.ones(1, 4), 0, assign=True)
        client.rows.push("t", keys[:5], torch.ones(5, 4), 3, num_workers=1)
    for st in cluster.stores:
        primary, backup = st.rows.snapshot(), backup_of[st.shard_index].rows.snapshot()
        order_p = torch.argsort(primary[1]["rows/t/keys"])
        order_b = torch.argsort(backup[1]["rows/t/keys"])
        for k in ("keys", "weight", "state/exp_avg", "state/exp_avg_sq", "updates"):
            assert torch.equal(primary[1][f"rows/t/{k}"][order_p], backup[1][f"rows/t/{k}"][order_b]), k
        assert primary[0]["t"]["steps"] == backup[0]["t"]["steps"] == 4


def test_a_row_push_from_before_a_rollback_is_refused_and_changes_nothing(make_cluster, tmp_path):
    """A client that registered dense tensors (a DistributedOptimizer's) knows the job's rollback epoch and
    its row pushes carry it: one computed before the job rolled back is answered ABORTED and changes no row
    (as a dense Push). Found by make test: two workers recovering at once roll the job back twice, and a row
    push of the first epoch's replay counted in the second's round, so the rows ran a step ahead of the
    dense weights. A client of row tables alone pushes unchecked, as before."""
    cluster = make_cluster(1, checkpoint_dir=str(tmp_path))
    keys = torch.arange(6)
    with shardps.connect(cluster.addresses, num_workers=2) as client, \
            shardps.connect(cluster.addresses, worker_id=1, num_workers=2) as alone:
        client.register({"w": torch.zeros(2)}, SGD(lr=1.0), sync="asp")
        client.rows.register("emb", 4, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        client.rows.push("emb", keys, torch.ones(6, 4), 0)
        client.checkpoint()
        saved = client.rows.pull("emb", keys)
        cluster.stores[0].rollback(cluster.stores[0].job.version, client.epoch + 1)  # another worker's rollback
        with pytest.raises(shardps.ShardError) as e:
            client.rows.push("emb", keys, torch.ones(6, 4), 1)
        assert e.value.code == grpc.StatusCode.ABORTED and "is in epoch 1, the request in 0" in str(e.value)
        assert torch.equal(client.rows.pull("emb", keys), saved)
        client.recover()
        client.rows.push("emb", keys, torch.ones(6, 4), 1)
        assert torch.equal(client.rows.pull("emb", keys), saved - 1.0)
        alone.rows.register("emb", 4, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        alone.rows.push("emb", keys, torch.ones(6, 4), 5)
        assert torch.equal(client.rows.pull("emb", keys), saved - 2.0)


def test_a_row_push_met_by_a_rollback_after_its_epoch_check_changes_nothing(make_cluster, tmp_path):
    """The epoch of a row push was checked when it came in, and the rows changed later under the shard's
    lock: a rollback in between (at this exact point: after the check, before the change) let a push of
    the epoch before reach the restored table. It is checked again where the rows change now."""
    cluster = make_cluster(1, checkpoint_dir=str(tmp_path))
    keys = torch.arange(6)
    store = cluster.stores[0]
    with shardps.connect(cluster.addresses) as client:
        client.register({"w": torch.zeros(2)}, SGD(lr=1.0), sync="asp")
        client.rows.register("emb", 4, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        client.rows.push("emb", keys, torch.ones(6, 4), 0)
        client.checkpoint()
        saved = client.rows.pull("emb", keys)
        held, rolled = store.rows.held.holds, []

        def holds(*args):  # asked between the servicer's epoch check and the push's change of the rows
            if not rolled:
                rolled.append(store.rollback(store.job.version, client.epoch + 1))
            return held(*args)

        store.rows.held.holds = holds
        with pytest.raises(shardps.ShardError) as e:
            client.rows.push("emb", keys, torch.ones(6, 4), 1)
        assert rolled == [(store.job.version, 1)]
        assert e.value.code == grpc.StatusCode.ABORTED and "is in epoch 1, the request in 0" in str(e.value)
        assert torch.equal(client.rows.pull("emb", keys), saved)
        client.recover()
        client.rows.push("emb", keys, torch.ones(6, 4), 1)
        assert torch.equal(client.rows.pull("emb", keys), saved - 1.0)
