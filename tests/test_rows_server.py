"""Row tables on the server side: SM3 on rows, bsp that follows leases, inf/nan steps, Stats, failover.

Real servers in this process on loopback ports (LocalCluster); faults are
injected at exact points (an eviction once the others are held at the
barrier, a primary stopped between two steps).
"""

from __future__ import annotations

import io
import threading

import grpc
import numpy as np
import pytest
import torch

import shardps
from shardps.admin import run_stats
from shardps.protos.optim import SGD, SM3, SparseAdam
from shardps.protos.rows import RowTableSpec, shard_of
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.rows.tables import RowTables
from shardps.worker.errors import Unreachable
from shardps.worker.rows.client import finite
from tests.helpers import run_workers


def test_sm3_rows_equal_the_reference_and_refuse_momentum(make_cluster):
    """SM3 on a row table against a NumPy transcription of google-research sm3's sparse path (the row
    cover set alone): nu = mu_i + g^2, w -= lr g / sqrt(nu + eps), mu_i = max_j nu. Untouched rows keep a
    zero accumulator; momentum, which that path does not apply, is refused rather than dropped."""
    cluster = make_cluster(2)
    rng = np.random.default_rng(1)
    lr, eps, n, dim = 0.3, 1e-6, 12, 5
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("t", dim, optimizer=SM3(lr=lr, eps=eps), seed=4)
        w = client.rows.pull("t", torch.arange(n)).numpy().astype(np.float64)
        mu = np.zeros(n)
        for step in range(15):
            ids = rng.integers(0, n - 3, 9)  # the last 3 rows are never touched
            g = rng.standard_normal((9, dim)).astype(np.float32)
            client.rows.push("t", torch.from_numpy(ids), torch.from_numpy(g), step)
            summed = np.zeros((n, dim))
            np.add.at(summed, ids, g.astype(np.float64))
            for r in np.unique(ids):
                nu = mu[r] + summed[r] ** 2
                w[r] -= lr * summed[r] / np.sqrt(nu + eps)
                mu[r] = nu.max()
        got = client.rows.pull("t", torch.arange(n)).numpy()
        with pytest.raises(ValueError, match="momentum"):
            client.rows.register("m", dim, optimizer=SM3(lr=0.1, momentum=0.9))
    assert np.allclose(got, w, atol=1e-5, rtol=0)
    for store in cluster.stores:
        t = store.rows.tables["t"]
        for key, slot in t.slots.items():
            assert t.state["accumulator"][slot].item() == pytest.approx(mu[key], rel=1e-5)


def test_bsp_row_steps_go_on_without_an_evicted_worker(make_cluster):
    """Three workers push a bsp table; two pushes of step 0 are taken in at once and held for the third, and
    a pull of worker 0 waits for their round. The third is evicted while that pull waits: the round completes
    with the mean of the two held (no wait until the deadline), the evicted worker's next push is refused
    naming it, and the next round needs only the live two."""
    cluster = make_cluster(2, max_wait_s=120.0)
    keys = torch.tensor([3, 4, 5, 6])
    clients = [shardps.connect(cluster.addresses, worker_id=k, num_workers=3, timeout=120) for k in range(3)]
    try:
        clients[0].rows.register("t", 2, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        for c in clients[1:]:
            c.rows.register("t", 2, optimizer=SGD(lr=1.0), init={"kind": "zeros"})
        pushed = {k: clients[k].rows.push("t", keys, torch.full((4, 2), float(k + 1)), 0, num_workers=3,
                                          sync="bsp") for k in (0, 1)}
        assert pushed == {0: 4, 1: 4}  # taken in, not applied: held for worker 2
        for store in cluster.stores:
            assert store.rows.tables["t"].policy.pending_workers == [0, 1] and store.rows.tables["t"].rounds == 0
        got: dict[str, torch.Tensor] = {}
        reader = threading.Thread(target=lambda: got.update(rows=clients[0].rows.pull("t", keys)))
        reader.start()
        for store in cluster.stores:  # the pull waits for round 1 on both shards (worker 0 pushed to both)
            with store.rows.lock:
                assert store.rows.lock.wait_for(lambda s=store: s.rows.waiting == 1, 60)
        for store in cluster.stores:
            store.leases.evict([2])
        reader.join(60)
        assert not reader.is_alive()
        assert torch.equal(got["rows"], torch.full((4, 2), -1.5))  # 0 - (1 + 2) / 2
        with pytest.raises(shardps.ShardError, match="worker 2 is gone from the job"):
            clients[2].rows.push("t", keys, torch.ones(4, 2), 1, num_workers=3, sync="bsp")
        run_workers(lambda k: clients[k].rows.push("t", keys, torch.full((4, 2), float(k + 1)), 1, num_workers=3,
                                                   sync="bsp"), 2)
        assert torch.equal(clients[0].rows.pull("t", keys), torch.full((4, 2), -3.0))
        assert sum(s.rows.stats()["t"]["steps"] for s in cluster.stores) == 4
    finally:
        for c in clients:
            c.close()


def test_a_step_with_inf_or_nan_is_skipped_on_every_shard_as_a_dense_one(make_cluster):
    """An inf/nan in a row push skips the step (no row, moment or step count changes; counted), as a dense
    step with found_inf: on the shard that finds it, and on the others when the worker says found_inf."""
    cluster = make_cluster(1)
    store = cluster.stores[0]
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("t", 3, optimizer=SparseAdam(lr=0.1))
        keys = torch.tensor([1, 2])
        client.rows.push("t", keys, torch.ones(2, 3), 0)
        before = client.rows.pull("t", keys)
        state = {k: v.clone() for k, v in store.rows.tables["t"].state.items()}
        bad = torch.ones(2, 3)
        bad[1, 2] = float("nan")
        client.rows.push("t", keys, bad, 1)
        stub = ps_pb2_grpc.RowsStub(grpc.insecure_channel(cluster.addresses[0]))
        answer = stub.PushRows(iter([ps_pb2.PushRowsRequest(  # finite here; the worker found an inf elsewhere
            table="t", key_dtype="uint64", keys=np.array([1], dtype="<u8").tobytes(),
            grads=np.ones(3, dtype="<f4").tobytes(), dim=3, step=2, found_inf=True)]), timeout=30)
        assert answer.skipped and answer.rows == 0 and answer.steps == 1
        retried = stub.PushRows(iter([ps_pb2.PushRowsRequest(table="t", key_dtype="uint64", dim=3, step=2)]),
                                timeout=30)
        assert retried.skipped  # a retry of a skipped step is answered as it was
        t = store.rows.tables["t"]
        assert torch.equal(client.rows.pull("t", keys), before) and t.steps == 1
        assert all(torch.equal(t.state[k], v) for k, v in state.items())
        assert store.rows.stats()["t"]["skipped"] == 2 and store.rows.stats()["t"]["duplicates"] == 1
        client.rows.push("t", keys, torch.ones(2, 3), 3)
        assert t.steps == 2


def test_a_held_push_is_applied_with_the_steps_push_and_bad_holds_change_nothing(make_cluster):
    """``PushRows`` with ``hold`` (an expert actor's held Backward): nothing applied, the gradients kept; the
    step's push without hold applies them summed with its own (SGD lr 1: the row moves by the sum), once;
    a hold sent again with its index is held once. A hold with assign, with another dim, or a stream that
    mixes hold flags is refused with INVALID_ARGUMENT, one of an unknown table with NOT_FOUND, each naming
    the table, and changes nothing."""
    cluster = make_cluster(1)
    store = cluster.stores[0]
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("h", 2, optimizer=SGD(lr=1.0))
        keys = torch.tensor([4, 9])
        before = client.rows.pull("h", keys)
        stub = ps_pb2_grpc.RowsStub(grpc.insecure_channel(cluster.addresses[0]))

        def push(k: list[int], g: list[float], step: int, **kw: object) -> ps_pb2.PushRowsResponse:
            return stub.PushRows(iter([ps_pb2.PushRowsRequest(
                table=kw.pop("table", "h"), key_dtype="uint64", keys=np.array(k, dtype="<u8").tobytes(),
                grads=np.array(g, dtype="<f4").tobytes(), dim=kw.pop("dim", 2), worker_id=0, step=step, **kw)]),
                timeout=30)

        for _ in range(2):  # the second: a retry, held once
            assert push([4], [1.0, 2.0], 0, hold=True, hold_index=0).rows == 0
        push([4, 9], [0.5, 0.5, 3.0, 3.0], 0, hold=True, hold_index=1)
        assert store.rows.tables["h"].steps == 0 and torch.equal(client.rows.pull("h", keys), before)
        invalid, missing = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        bad = [(dict(hold=True, assign=True), invalid), (dict(hold=True, dim=3), invalid),
               (dict(hold=True, table="nope"), missing)]
        for kw, code in bad:
            with pytest.raises(grpc.RpcError) as e:
                push([9], [9.0, 9.0], 0, hold_index=2, **kw)
            assert e.value.code() == code and "row table" in e.value.details(), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.PushRows(iter([ps_pb2.PushRowsRequest(table="h", key_dtype="uint64", dim=2, step=0, hold=True,
                                                       hold_index=3),
                                ps_pb2.PushRowsRequest(table="h", key_dtype="uint64", dim=2, step=0)]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hold" in e.value.details()
        assert push([9], [1.0, 1.0], 0).rows == 2  # the step's push: the holds and its own
        after = client.rows.pull("h", keys)
        torch.testing.assert_close(before - after, torch.tensor([[1.5, 2.5], [4.0, 4.0]]), rtol=0, atol=1e-6)
        assert push([9], [1.0, 1.0], 0).rows == 0  # a retry of the step's push: a duplicate, nothing again
        assert torch.equal(client.rows.pull("h", keys), after) and store.rows.tables["h"].steps == 1
        assert not store.rows.held.holds("h", 0, 0)


def test_the_worker_says_found_inf_to_every_shard_of_a_push(make_cluster):
    """A NaN in one row, on one shard: the worker tells every shard, so each skips the step (its rows,
    moments and step count unchanged, ``skipped`` counted) and their SparseAdam step counts stay equal;
    ``found_inf=True`` on finite gradients skips alike."""
    cluster = make_cluster(2)
    keys = torch.arange(40)
    owner = shard_of(keys.numpy().view(np.uint64), 2)
    assert set(owner.tolist()) == {0, 1}
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("t", 4, optimizer=SparseAdam(lr=0.1))
        client.rows.push("t", keys, torch.ones(40, 4), 0)
        before = client.rows.pull("t", keys)
        tables = [st.rows.tables["t"] for st in cluster.stores]
        states = [{k: v.clone() for k, v in t.state.items()} for t in tables]
        bad = torch.ones(40, 4)
        bad[int(np.flatnonzero(owner == 0)[0]), 1] = float("nan")  # on shard 0 alone
        assert client.rows.push("t", keys, bad, 1) == 0
        assert client.rows.push("t", keys, torch.ones(40, 4), 2, found_inf=True) == 0
        assert torch.equal(client.rows.pull("t", keys), before)
        for t, state in zip(tables, states, strict=True):
            assert t.steps == 1 and t.counts["skipped"] == 2
            assert all(torch.equal(t.state[k], v) for k, v in state.items())
        assert client.rows.push("t", keys, torch.ones(40, 4), 3) == 40
        assert [t.steps for t in tables] == [2, 2]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [0, 1, 4095])
def test_finite_finds_any_inf_or_nan(value, at):
    g = torch.randn(64, 64)
    assert finite(g) and finite(torch.zeros(0, 64)) and finite(torch.full((3, 2), 3e38))
    g.view(-1)[at] = value
    assert not finite(g)


def test_stats_and_shardps_stats_show_row_tables(make_cluster):
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses) as client:
        client.rows.register("emb", 4, optimizer=SparseAdam(), admit=2)
        client.rows.push("emb", torch.arange(10), torch.ones(10, 4), 0)
        client.rows.push("emb", torch.arange(6), torch.ones(6, 4), 1)
        got = client.stats()
        out = io.StringIO()
        run_stats(cluster.addresses, out=out)
    for s, store in zip(got, cluster.stores, strict=True):
        [t] = s["row_tables"]
        want = store.rows.stats()["emb"]
        assert {k: t[k] for k in want} == want and t["dim"] == 4 and t["optimizer"] == "sparse_adam"
    assert sum(s["row_tables"][0]["rows"] for s in got) == 6
    assert sum(s["row_tables"][0]["admitted"] for s in got) == 6
    assert sum(s["row_tables"][0]["pending_admission"] for s in got) == 4
    text = out.getvalue()
    assert "row table" in text and text.count(" emb ") == 2


@pytest.mark.parametrize("dense", [True, False], ids=["with-dense", "rows-only"])
def test_a_row_table_survives_its_primary_and_rows_reshard(make_cluster, tmp_path, dense):
    """--replicas 2: shard 0's primary stops between two steps; the worker fails over to its backup and the
    table goes on: its rows equal a single table's fed the same pushes, bit for bit. The worker learns the
    backups from its dense registration or, using row tables alone, from RegisterRows (no attach()). Then
    the 2 shards' checkpoints are read into 3 shards: every row, its moments and the step count are where
    the new count puts them, and a further step gives the same rows as on the 2 shards."""
    cluster = make_cluster(2, replicas=2)
    spec = RowTableSpec("emb", 8, SparseAdam(lr=0.05), seed=2)
    ref = RowTables()
    ref.register(spec)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(-40, 40, (6, 30), generator=gen)
    grads = torch.randn(6, 30, 8, generator=gen)
    with shardps.connect(cluster.addresses, timeout=60) as client:
        if dense:
            client.register({"b": torch.zeros(2)}, SGD(lr=0.1))  # the dense part: it learns the backups
        assert client.backups == (cluster.backup_addresses if dense else ["", ""])
        client.rows.register("emb", 8, optimizer=SparseAdam(lr=0.05), seed=2)
        assert client.backups == cluster.backup_addresses
        for step in range(6):
            if step == 3:
                cluster.stop_server(1)  # shard 0's primary goes away
            client.rows.push("emb", keys[step], grads[step], step)
            ref.push("emb", 8, keys[step].numpy().view(np.uint64), grads[step], step=step)
        every = torch.arange(-45, 45)  # 10 never pushed: their init, on the backup too
        got = client.rows.pull("emb", every)
        assert client.transport.failovers_total == 1
        want, _ = ref.pull("emb", 8, np.unique(every.numpy().view(np.uint64)))
        order = np.argsort(np.argsort(every.numpy().view(np.uint64)))
        assert torch.equal(got, want[torch.from_numpy(order)])
        promoted = next(b for b in cluster.backups if b.shard_index == 0)
        for store in (promoted, cluster.stores[1]):
            store.checkpointer.enable(str(tmp_path), every_steps=0)
            store.checkpoint_now()
    resharded = [RowTables() for _ in range(3)]
    for i, tables in enumerate(resharded):
        tables.restore_resharded(str(tmp_path), i, 3)
    keys_u64 = np.unique(every.numpy().view(np.uint64))  # every row the 2 shards held: all were pulled
    for i, tables in enumerate(resharded):
        t = tables.tables["emb"]
        mine = keys_u64[shard_of(keys_u64, 3) == i]
        assert sorted(t.slots) == sorted(mine.tolist()) and t.steps == 6
        rows, _ = tables.pull("emb", 8, mine)
        assert torch.equal(rows, ref.pull("emb", 8, mine)[0])
        step_keys = keys_u64[shard_of(keys_u64, 3) == i]
        tables.push("emb", 8, step_keys, torch.ones(len(step_keys), 8), step=6)
    ref.push("emb", 8, keys_u64, torch.ones(len(keys_u64), 8), step=6)
    for i, tables in enumerate(resharded):
        mine = keys_u64[shard_of(keys_u64, 3) == i]
        assert torch.equal(tables.pull("emb", 8, mine)[0], ref.pull("emb", 8, mine)[0])


def test_a_row_call_to_a_shard_that_is_down_fails_naming_its_table(make_cluster):
    """No backup: a pull, a push and a registration to a stopped shard fail, once the client's retries
    end, as Unreachable naming the table and the call (and how a client learns backups); a shard's own
    refusal, which names the table already, is not named twice."""
    cluster = make_cluster(2)
    with shardps.connect(cluster.addresses, timeout=10, recovery_timeout=0.5) as client:
        client.rows.register("emb", 4, optimizer=SGD(lr=0.1))
        with pytest.raises(shardps.ShardError, match=r"^shard \d \(.*\): FAILED_PRECONDITION: row table 'emb': reg"):
            client.rows.register("emb", 5)  # another spec under the name
        cluster.stop_server(1)
        calls = {"PullRows": lambda: client.rows.pull("emb", torch.arange(6)),
                 "PushRows": lambda: client.rows.push("emb", torch.arange(6), torch.ones(6, 4), 0),
                 "RegisterRows": lambda: client.rows.register("other", 4)}
        for call, fn in calls.items():
            with pytest.raises(Unreachable, match=rf"row table '(emb|other)': {call}: .*attach\(\)") as e:
                fn()
            assert e.value.shard == 1
