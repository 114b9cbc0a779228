"""--coordinator: who serves a shard is etcd's to say (server/coordinator.py), with real servers on loopback and a
real etcd (Debian's, `make tools`). Every push adds exactly 1.0 to the weight (SGD, lr 1, a gradient of -1), so
the weight counts the pushes it holds: an acknowledged push is 1 in the final weights, never 0 and never 2.

The faults come at exact points: a primary's lease renewals are stopped (its link to etcd cut, from its own
side), then the test waits for states (the holder key gone in etcd, a takeover), never for moments."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time

import grpc
import pytest
import torch

import shardps
from shardps.admin import run_attach_replica
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.coordinator import Etcd, LocalEtcd, ShardLease
from shardps.server.service import create_server, stop_server
from shardps.server.store import ShardStore
from shardps.testing.frames import FrameStub
from tests.helpers import ETCD_MISSING

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(shutil.which("etcd") is None, reason=ETCD_MISSING)]

TTL = 2


@pytest.fixture(scope="module")
def etcd_server():
    with LocalEtcd() as e:
        yield e


_jobs = iter(range(10**6))


@pytest.fixture
def job():
    return f"fence{next(_jobs)}"


def wait_for(what, cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def push_one(client, step):
    client.push({"w": -torch.ones(4)}, step=step)


def weight(store) -> float:
    """The first coordinate of ``w`` that ``store`` holds: how many pushes it applied."""
    tensors = store.snapshot()[2]
    return float(next(t for k, t in tensors.items() if k.endswith("/weight"))[0])


def test_a_primary_cut_from_etcd_stops_acknowledging_and_its_backup_takes_over_once_its_lease_expired(
        make_cluster, etcd_server, job):
    c = make_cluster(2, replicas=2, coordinator=etcd_server.url, job=job, coordinator_ttl=TTL)
    primary, backup = c.stores[0], c.backups[1]  # server 1 holds shard 0's backup
    etcd = Etcd(etcd_server.endpoints)
    try:
        with shardps.connect(c.addresses, backups=c.backup_addresses, recovery_timeout=30.0) as client:
            client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
            for step in range(3):
                push_one(client, step)
            assert c.fences[0].epoch == 1 and primary.job.version == 3
            c.fences[0].close(release=False)  # shard 0's primary can no longer renew: etcd is cut off from it
            assert "this server stopped holding it" in c.fences[0].why_not()
            # it refuses at once, naming why; nothing is applied
            stub = ps_pb2_grpc.WorkersStub(grpc.insecure_channel(c.addresses[0]))
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=0), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shard 0: this server stopped holding it" in e.value.details()
            # the backup takes over only once etcd let the old lease expire: the worker's push waits for that
            for step in range(3, 6):
                push_one(client, step)
            assert client.failovers_total == 1 and client.addresses[0] == c.backup_addresses[0]
        record = ShardLease(etcd, job, 0, "observer:0").read()
        assert record is not None and (record.primary, record.epoch) == (c.backup_addresses[0], 2)
        assert primary.job.version == 3 and weight(primary) == 3.0  # acknowledged nothing after its lease lapsed
        assert backup.job.version == 6 and weight(backup) == 6.0  # every acknowledged push once: 3 + 3
    finally:
        etcd.close()


def test_a_backup_does_not_take_over_while_the_primary_holds_its_lease(make_cluster, etcd_server, job):
    c = make_cluster(2, replicas=2, coordinator=etcd_server.url, job=job, coordinator_ttl=TTL)
    with shardps.connect(c.addresses) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
    stub = ps_pb2_grpc.WorkersStub(grpc.insecure_channel(c.backup_addresses[0]))
    with pytest.raises(grpc.RpcError) as e:
        stub.TakeOver(ps_pb2.TakeOverRequest(reason="test"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"the primary of shard 0 at {c.addresses[0]} still holds its lease in etcd" in e.value.details()
    assert c.backups[1].replica.role == "backup"


def test_a_primary_whose_backup_is_lost_goes_on_alone_only_as_etcd_records_it(make_cluster, etcd_server, job):
    c = make_cluster(2, replicas=2, coordinator=etcd_server.url, job=job, coordinator_ttl=TTL)
    etcd = Etcd(etcd_server.endpoints)
    try:
        with shardps.connect(c.addresses) as client:
            client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
            push_one(client, 0)
            assert not ShardLease(etcd, job, 0, "observer:0").read().alone
            c.stop_server(2)  # server 1's backup endpoint (shard 0's backup) goes away
            push_one(client, 1)  # acknowledged only once etcd recorded that the primary goes alone
            assert c.stores[0].stats().replica_state == "degraded" and weight(c.stores[0]) == 2.0
        record = ShardLease(etcd, job, 0, "observer:0").read()
        assert record is not None and record.alone and record.epoch == 1
    finally:
        etcd.close()


@pytest.mark.fault
def test_a_primary_alone_whose_new_backup_is_in_sync_is_recorded_with_it_and_that_backup_may_take_over(
        make_cluster, etcd_server, job):
    """Alone, a shard could never fail over again: its backup's copy is stale while etcd says so. Once a backup
    (here a spare, attached) holds every change again, the primary's next acknowledgement records that in etcd,
    and that backup wins a takeover once the primary's lease is gone."""
    c = make_cluster(2, replicas=2, coordinator=etcd_server.url, job=job, coordinator_ttl=TTL)
    etcd = Etcd(etcd_server.endpoints)
    spare = ShardStore(0, 2, role="backup")
    server, port = create_server(spare)
    spare.replica.fence = ShardLease(etcd, job, 0, f"127.0.0.1:{port}", ttl=TTL)
    try:
        with shardps.connect(c.addresses) as client:
            client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
            push_one(client, 0)
            c.stop_server(2)  # shard 0's backup goes away: the primary goes on alone
            push_one(client, 1)
            assert ShardLease(etcd, job, 0, "observer:0").read().alone
            assert run_attach_replica(c.addresses, 0, f"127.0.0.1:{port}", out=io.StringIO()) == 0
            push_one(client, 2)  # acknowledged with the spare in sync: etcd records the primary with it again
        record = ShardLease(etcd, job, 0, "observer:0").read()
        assert record is not None and not record.alone and record.epoch == 1
        assert weight(spare) == 3.0
        c.fences[0].close(release=False)  # the primary stops renewing (cut from etcd)
        stub = ps_pb2_grpc.WorkersStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 30
        while True:  # refused while the old lease holds in etcd; granted once etcd let it expire
            try:
                got = stub.TakeOver(ps_pb2.TakeOverRequest(reason="test"), timeout=10)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "still holds its lease" in e.details()
                assert time.monotonic() < deadline, e.details()
                time.sleep(0.2)  # etcd's clock lets the lease go
        assert (got.shard_index, got.version, got.fence_epoch) == (0, spare.job.version, 2)
    finally:
        stop_server(server)
        spare.replica.fence.close()  # its lease, renewed since it took over, before the client it renews with
        etcd.close()


def test_a_coordinator_that_does_not_answer_is_named_at_start_within_the_start_timeout(tmp_path):
    dead = LocalEtcd()  # its free ports, nothing on them
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "shardps", "server", "--port", "0", "--coordinator", dead.url,
                        "--start-timeout", "3"], capture_output=True, text=True, timeout=120)
    dead.close()
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"the coordinator {dead.url} does not answer (within 3s)" in p.stderr
    assert time.monotonic() - t0 < 60


def test_bad_coordinator_flags_are_refused_naming_them():
    for flags, msg in ((["--coordinator", "http://x:1"], "expected etcd://HOST:PORT"),
                       (["--coordinator", "etcd://a:1", "--job", "a/b"], "job 'a/b': expected 1-64 letters"),
                       (["--coordinator", "etcd://a:1", "--coordinator-ttl", "1"],
                        "--coordinator-ttl must be at least 2")):
        p = subprocess.run([sys.executable, "-m", "shardps", "server", "--port", "0", *flags], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr, (flags, p.stderr[-2000:])


def _push_request(worker: int, step: int, fence_epoch: int) -> ps_pb2.PushRequest:
    """A header-only Push (no gradients) carrying ``fence_epoch``: what a worker that missed a takeover sends."""
    return ps_pb2.PushRequest(worker_id=worker, step=step, ends_with_last=True, last=True, fence_epoch=fence_epoch)


def test_requests_carry_the_fencing_epoch_and_one_not_the_primarys_is_refused_naming_both(
        make_cluster, etcd_server, job):
    c = make_cluster(2, replicas=2, coordinator=etcd_server.url, job=job, coordinator_ttl=TTL)
    with shardps.connect(c.addresses, backups=c.backup_addresses, recovery_timeout=30.0) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
        assert client.transport.fence_epochs == [1, 1]  # learnt at Register
        push_one(client, 0)
        c.fences[0].close(release=False)
        push_one(client, 1)  # fails over once the lease expired
        assert client.transport.fence_epochs[0] == 2  # learnt from the takeover's answer
        new = c.backups[1]
        version = new.job.version
        stub = FrameStub(c.backup_addresses[0])  # Push and Pull as a data connection's frames
        with pytest.raises(grpc.RpcError) as e:
            stub.Push([_push_request(0, 2, 1)], timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "worker 0's push of step 2 of fencing epoch 1, older than this primary's 2" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Pull(ps_pb2.PullRequest(worker_id=0, fence_epoch=3), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker 0's pull of fencing epoch 3, newer than this server's 2" in e.value.details()
        assert new.job.version == version  # nothing applied
        stub.close()
        push_one(client, 2)  # the worker's own requests carry 2: accepted
        assert new.job.version == version + 1


def test_a_backup_refuses_ops_of_an_older_fencing_epoch_than_it_saw_and_deposes_their_sender(
        make_cluster, etcd_server, job):
    c = make_cluster(2, replicas=2, coordinator=etcd_server.url, job=job, coordinator_ttl=TTL)
    with shardps.connect(c.addresses, recovery_timeout=1.0) as client:
        client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=1.0), sync="asp")
        push_one(client, 0)
        backup = c.backups[1]
        assert backup.replica.fence_epoch_seen == 1  # every op carries its primary's epoch
        backup.replica.fence_epoch_seen = 3  # as if a newer primary's ops had reached it
        with pytest.raises(shardps.ShardError) as e:
            push_one(client, 1)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert c.stores[0].replica.role == "deposed"
    assert weight(backup) == 1.0  # the refused op was not replayed
