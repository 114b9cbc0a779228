"""Each part of the store built and driven alone, without a ShardStore: given a lock and fakes for the rest."""

from __future__ import annotations

import threading

import pytest
import torch

import shardps
from shardps.server.checkpoint import Checkpointer
from shardps.server.datapath.apply import Applier
from shardps.server.datapath.reader import Reader
from shardps.server.errors import Aborted, DeadlineExceeded, FailedPrecondition, Unavailable
from shardps.server.job import Job
from shardps.server.membership import Leases, Membership
from shardps.server.replication.roles import OpKind, Role
from shardps.server.replication.state import ReplicaSide
from shardps.server.sync import Contribution, Update
from shardps.server.table import TensorEntry, TensorSpec, TensorTable


class Recorded:
    """A Recorder that keeps what it is given."""

    recording = True

    def __init__(self) -> None:
        self.ops: list[tuple[OpKind, dict]] = []

    def record(self, kind, args, tensors=None, packed=None):
        self.ops.append((kind, args))


def _table(n: int = 4) -> TensorTable:
    table = TensorTable(0)
    spec = TensorSpec("w", (n,), 1, shardps.optim.SGD(lr=0.5), ((0, n),))
    table.add([TensorEntry.create(spec, {("w", 0): torch.ones(n)})])
    return table


def test_leases_alone_record_each_change_and_report_the_live_workers():
    now = [0.0]
    cond, rec, changed = threading.Condition(), Recorded(), []
    m = Membership(0, lease_s=1.0, clock=lambda: now[0])
    m.num_workers = 2
    leases = Leases(cond, rec, m, on_live_changed=changed.append)
    leases.register(0)
    leases.register(1)
    now[0] = 5.0
    leases.touch(1)
    assert leases.evict_expired() == [0] and leases.live() == {1} and leases.evictions_total == 1
    assert leases.leave(1) and not leases.leave(1)
    assert [k for k, _ in rec.ops] == [OpKind.REGISTER_WORKER, OpKind.REGISTER_WORKER, OpKind.EVICT, OpKind.LEAVE]
    assert changed == [{1}, set()]


def test_leases_of_a_backup_do_not_evict():
    m = Membership(0, lease_s=1.0, clock=lambda: 10.0)
    m.num_workers, m.workers, m.last_seen = 1, {0}, {0: 0.0}
    leases = Leases(threading.Condition(), Recorded(), m, may_evict=lambda: False)
    assert leases.evict_expired() == [] and leases.live() == {0}


def test_applier_alone_steps_its_table_and_counts():
    table, cond = _table(), threading.Condition()
    applier = Applier(0, cond, table)
    seen: list[float] = []
    applier.on_apply.append(seen.append)
    with cond:
        applied = applier.step(Update({("w", 0): torch.full((4,), 2.0)}, [Contribution(0, 0, 0)]), version=0)
    assert applied and torch.equal(table["w"].parts[0].weight, torch.zeros(4))  # 1 - 0.5 * 2
    assert (applier.applied_updates_total, applier.gradients_applied_total, applier.skipped_steps_total) == (1, 1, 0)
    assert len(seen) == 1 and applier.staleness_counts == {0: 1} and not applier.applying
    with cond:
        assert not applier.step(Update({("w", 0): torch.ones(4)}, [Contribution(0, 1, 0, found_inf=True)]), 1)
    assert applier.skipped_steps_total == 1 and torch.equal(table["w"].parts[0].weight, torch.zeros(4))


def test_reader_alone_reads_one_version_and_says_who_read():
    table, cond = _table(), threading.Condition()
    job = Job(0, cond, live=set, moved_to=str, checkpoints=list)
    job.version = 7
    reads: list[tuple[int | None, list[str]]] = []
    reader = Reader(0, cond, table, job, on_read=lambda w, names: reads.append((w, names)))
    version, items = reader.read(["w"], None, 1024)
    assert version == 7 and [(n, off) for n, off, _, _ in items] == [("w", 0)]
    assert reads == [(None, ["w"])] and reader.pulls_total == 1 and reader.pull_bytes_total == 16
    _, framed = reader.read(["w"], None, 1024, messages=True, worker_id=3)
    _, again = reader.read(["w"], None, 1024, messages=True, worker_id=3)
    assert again is framed and reader.cache.hits_total == 1  # one framing per version, shared
    with cond:
        reader.before_write()  # no read in progress: returns at once, and the cache is cleared
    _, fresh = reader.read(["w"], None, 1024, messages=True, worker_id=3)
    assert fresh is not framed and reader.cache.hits_total == 1 and reader.reading == 0


def test_job_alone_waits_with_a_deadline_and_refuses_a_stale_epoch():
    cond = threading.Condition()
    job = Job(2, cond, live=lambda: {0, 1}, moved_to=str, checkpoints=lambda: [4])
    job.worker_clocks = {0: 3}
    with pytest.raises(DeadlineExceeded, match="shard 2 is at version 0, waited 0.0s for version 1"):
        job.wait_version(1, 0.0)
    with pytest.raises(DeadlineExceeded, match=r"behind: \{1: 0\}"):
        job.wait_clock(1, 0.0)
    job.epoch = 1
    with pytest.raises(Aborted, match="resync"):
        job.check_epoch(0)
    job.recovering = True
    with pytest.raises(Aborted, match=r"versions here: \[4\]"):
        job.check_epoch(1)


def test_job_waits_end_when_the_shard_is_taken_over():
    moved = [""]
    cond = threading.Condition()
    job = Job(0, cond, live=set, moved_to=lambda: moved[0], checkpoints=list)

    def depose() -> None:
        with cond:
            moved[0] = "backup:1"
            cond.notify_all()

    threading.Timer(0.05, depose).start()
    with pytest.raises(Unavailable, match="taken over by its backup at backup:1"):
        job.wait_version(1, 30.0)


class Replayed:
    """A Replayer with nothing to replay: version and epoch only."""

    version, epoch = 5, 2

    def renew_leases_locked(self) -> None:
        pass


def test_replica_side_alone_serves_by_role_and_takes_over_only_with_a_copy():
    side = ReplicaSide(1, 2, threading.Condition(), Replayed(), role=Role.BACKUP)  # type: ignore[arg-type]
    assert not side.recording
    side.record(OpKind.LEAVE, {"worker": 0})  # no backup of its own: nothing to record into
    with pytest.raises(Unavailable, match="this is a backup of shard 1"):
        side.check_serving()
    with pytest.raises(FailedPrecondition, match="holds no copy of shard 1 yet"):
        side.promote(force=True)
    side.replica_synced = True
    assert side.promote(force=True) == (1, 5, 2) and side.role is Role.PRIMARY and side.promotions_total == 1
    side.check_serving()


def test_checkpointer_alone_keeps_the_schedule_and_the_files(tmp_path):
    ck = Checkpointer(0)
    assert not ck.due(4) and ck.versions() == [] and ck.latest() is None
    ck.enable(str(tmp_path), every_steps=2, keep=2)
    assert ck.due(4) and not ck.due(3)
    for v in (2, 4, 6):
        ck.write(lambda v=v: (v, {"note": v}, {"t": torch.full((2,), float(v))}))
    assert ck.versions() == [4, 6] and ck.checkpoints_total == 3 and not ck.due(6)
    c = ck.latest()
    assert c is not None and c.version == 6 and torch.equal(c.tensors()["t"], torch.full((2,), 6.0))
    with pytest.raises(FailedPrecondition, match="cannot roll back to version 2"):
        ck.load(2)
