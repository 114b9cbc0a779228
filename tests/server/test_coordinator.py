"""server/coordinator.py against a real etcd (Debian's, `make tools`) on free loopback ports: a shard's record,
the primary's lease and what ends it, takeover and going alone as transactions that exactly one server
wins, and the clear errors (an address that does not answer, a record changed by hand)."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from shardps.server.coordinator import (
    CoordinatorError,
    Etcd,
    LocalEtcd,
    ShardLease,
    parse,
)
from tests.helpers import ETCD_MISSING

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason=ETCD_MISSING)

TTL = 2  # seconds: the shortest lease the module takes, so that expiries come soon


@pytest.fixture(scope="module")
def etcd_server():
    with LocalEtcd() as e:
        yield e


@pytest.fixture
def etcd(etcd_server):
    client = Etcd(etcd_server.endpoints)
    yield client
    client.close()


_jobs = iter(range(10**6))


@pytest.fixture
def job():
    return f"job{next(_jobs)}"


def lease(etcd: Etcd, job: str, address: str, shard: int = 0) -> ShardLease:
    return ShardLease(etcd, job, shard, address, ttl=TTL, margin=0.5)


def wait_for(what, cond, timeout=15.0):
    """Until ``cond()`` (a state, not a moment): the lease's expiry is etcd's to decide."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_parse_takes_endpoints_and_names_what_is_wrong():
    assert parse("etcd://10.0.0.1:2379,etcd-b:2380") == ["10.0.0.1:2379", "etcd-b:2380"]
    with pytest.raises(ValueError, match=r"coordinator 'http://x:1': expected etcd://HOST:PORT"):
        parse("http://x:1")
    with pytest.raises(ValueError, match=r"'x' is not HOST:PORT"):
        parse("etcd://a:1,x")


def test_an_address_that_does_not_answer_is_named_within_the_timeout():
    dead = LocalEtcd()  # its ports, nothing started on them
    etcd = Etcd(dead.endpoints, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError, match=rf"the coordinator etcd://{dead.endpoints[0]} does not answer "
                                               r"\(within 2s\)"):
        etcd.check(2.0)
    assert time.monotonic() - t0 < 5
    etcd.close()
    dead.close()


def test_the_first_primary_claims_epoch_1_and_holds_while_it_renews(etcd, job):
    a = lease(etcd, job, "a:1")
    try:
        rec = a.claim(timeout=10)
        assert (rec.primary, rec.epoch, rec.alone) == ("a:1", 1, False)
        assert a.holds() and a.why_not() == ""
        renewed = a._renewed_at
        wait_for("a renewal", lambda: a._renewed_at > renewed)  # the background renewal, not a push
        # It holds a whole term from that renewal on (measured from the renewal, not from when this thread
        # looks: a loaded machine may run it later than the term's end, and then the next renewal is due).
        with a._mu:
            assert not a._lost and a._valid_until >= a._renewed_at + a.ttl - a.margin
        stored = lease(etcd, job, "x:9").read()
        assert stored is not None and (stored.primary, stored.epoch, stored.alone) == ("a:1", 1, False)
        assert stored.holder > 0
    finally:
        a.close()


def test_a_second_server_cannot_claim_a_shard_another_serves(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    try:
        with pytest.raises(CoordinatorError, match=r"names a:1 the primary of shard 0 \(epoch 1; key "
                                                   rf"/shardps/{job}/shards/0\), not this server at b:2"):
            lease(etcd, job, "b:2").claim(timeout=1)
    finally:
        a.close()


def test_the_backup_takes_over_only_once_the_primarys_lease_is_gone_and_raises_the_epoch(etcd, job):
    a, b = lease(etcd, job, "a:1"), lease(etcd, job, "b:2")
    a.claim(timeout=10)
    try:
        with pytest.raises(CoordinatorError, match=r"the primary of shard 0 at a:1 still holds its lease"):
            b.take_over("a:1")
        a.close(release=False)  # a stops renewing (as if cut off): its lease expires in etcd, by etcd's clock
        assert not a.holds() and "stopped holding" in a.why_not()
        wait_for("the lease's expiry", lambda: lease(etcd, job, "x:9").read().holder == 0)
        rec = b.take_over("a:1")
        assert (rec.primary, rec.epoch) == ("b:2", 2) and b.holds()
        with pytest.raises(CoordinatorError, match=r"names b:2 the primary of shard 0 \(epoch 2"):
            lease(etcd, job, "a:1").claim(timeout=1)  # the old primary, restarted, does not serve again
    finally:
        b.close()


def test_a_takeover_is_won_by_exactly_one_backup(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    a.close()  # released: no lease holds the shard
    rivals = [lease(etcd, job, f"b{i}:2") for i in range(4)]
    won, errors = [], []
    barrier = threading.Barrier(len(rivals))

    def go(x: ShardLease) -> None:
        barrier.wait(10)
        try:
            won.append(x.take_over("a:1"))
        except CoordinatorError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=go, args=(x,)) for x in rivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert len(won) == 1 and len(errors) == 3, (won, errors)
        assert won[0].epoch == 2
        stored = lease(etcd, job, "x:9").read()
        assert stored is not None and stored.primary == won[0].primary
    finally:
        for x in rivals:
            x.close()


def test_a_primary_that_goes_alone_makes_its_backups_copy_stale(etcd, job):
    a, b = lease(etcd, job, "a:1"), lease(etcd, job, "b:2")
    a.claim(timeout=10)
    try:
        assert a.go_alone() and a.record is not None and a.record.alone
        a.close()  # even with its lease gone
        with pytest.raises(CoordinatorError, match=r"went on without its backup \(epoch 1\): this backup's copy is "
                                                   r"stale; not taking over"):
            b.take_over("a:1")
    finally:
        a.close()


def test_a_primary_whose_lease_expired_cannot_go_alone(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    a.close(release=False)
    assert not a.go_alone()


def test_a_record_changed_by_hand_to_nonsense_is_refused_naming_the_key(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    try:
        etcd.put(a.key, b"primary=a:1")
        with pytest.raises(CoordinatorError, match=rf"etcd key /shardps/{job}/shards/0 holds 'primary=a:1', not a "
                                                   r"shard record .* \(it never guesses\)"):
            lease(etcd, job, "b:2").take_over("a:1")
        etcd.put(a.key, b'{"primary": "a:1", "epoch": true, "alone": false}')
        with pytest.raises(CoordinatorError, match=r"not a shard record"):
            a.read()
    finally:
        a.close()


def test_a_restarted_primary_holds_its_shard_again_at_the_same_epoch(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    a.close()  # a clean stop releases the lease
    again = lease(etcd, job, "a:1")
    try:
        assert again.claim(timeout=10).epoch == 1  # no one else served it: its workers' epoch stays good
    finally:
        again.close()


def test_etcd_restarted_the_primary_stops_acknowledging_until_it_renews(etcd_server, job):
    """etcd down longer than the margin allows: the primary's own clock says it is not sure any more."""
    etcd = Etcd(etcd_server.endpoints, timeout=0.5)
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    try:
        etcd_server.stop()
        wait_for("the lease's margin", lambda: not a.holds())
        assert "was last renewed" in a.why_not() and "not sure it is still the primary" in a.why_not()
        etcd_server.start()
        # etcd keeps the lease's time-to-live across its restart (it renews every lease on becoming leader)
        wait_for("a renewal after the restart", a.holds, timeout=20)
    finally:
        a.close()
        etcd.close()


def test_a_primary_whose_lease_expired_takes_it_again_at_the_same_epoch_if_no_one_took_the_shard(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    try:
        first = a._lease
        etcd.revoke(first)  # as if etcd let it expire while a was cut off from it
        wait_for("the lease held again", lambda: a._lease != first and a.holds())
        assert a.epoch == 1 and lease(etcd, job, "x:9").read().holder > 0
    finally:
        a.close()


def test_a_primary_whose_lease_expired_and_whose_backup_took_over_serves_nothing_more(etcd, job):
    a, b = lease(etcd, job, "a:1"), lease(etcd, job, "b:2")
    a.claim(timeout=10)
    try:
        a._stop.set()  # its renewals stop (cut off from etcd) ...
        a._thread.join(10)
        etcd.revoke(a._lease)  # ... its lease expires, and the backup takes over
        assert b.take_over("a:1").epoch == 2
        a._stop.clear()
        assert not a._reclaim()
        assert not a.holds() and "etcd now names b:2 at epoch 2 its primary" in a.why_not()
    finally:
        a.close()
        b.close()


def test_a_primary_restarted_while_its_old_lease_lives_claims_once_etcd_lets_it_expire(etcd, job):
    a = lease(etcd, job, "a:1")
    a.claim(timeout=10)
    a.close(release=False)  # killed: its lease lives on in etcd until its time-to-live runs out
    again = lease(etcd, job, "a:1")
    try:
        assert again.claim(timeout=15).epoch == 1  # waited on a watch of the old lease's key, then claimed
        assert again.holds()
        with pytest.raises(CoordinatorError, match=r"a lease still holds its key .* after 0.5s"):
            lease(etcd, job, "a:1").claim(timeout=0.5)  # held now: not freed within the timeout
    finally:
        again.close()
