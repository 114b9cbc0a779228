"""The partition harness (deploy/partitions.py), a short run of each nemesis: nothing acknowledged is lost or
applied twice, no version of a shard is acknowledged twice, epochs only rise, and the job goes on after the heal.

``make partition`` runs each 20 times (docs/operations.md's table); here each runs once, one push a worker before
the fault and after it. A fault starts between two given pushes and lasts until it took effect (a state of the
cluster, asked after each round of pushes, within a deadline), then heals: what is asserted does not depend on the
machine's speed. Needs root (network namespaces) and etcd (``make tools``): skipped, saying which, without them.
"""

from __future__ import annotations

import shutil

import pytest

from shardps.deploy.partitions import NEMESES, Harness
from shardps.netsim import unavailable
from tests.helpers import ETCD_MISSING

REASON = unavailable()
pytestmark = [pytest.mark.fault, pytest.mark.cluster, pytest.mark.xdist_group("partition-harness"),
              pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.skipif(shutil.which("etcd") is None, reason=ETCD_MISSING)]

TAKEOVER = {"primary-cut", "halves", "isolate", "pause", "etcd-cut"}  # shard 1's backup serves it after these


@pytest.fixture(scope="module")
def harness():
    with Harness(before=1, during=0, after=1) as h:  # the fault ends once it took effect
        yield h


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(NEMESES))
def test_no_acknowledged_push_is_lost_or_applied_twice_and_the_job_goes_on(harness, name):
    r = harness.run(NEMESES[name], 0)
    print(r.line())
    assert r.tally is not None, r.error
    assert r.tally.violations == [], r.line()
    assert r.rounds > 0 and r.went_on and not r.error, r.line()
    assert r.tally.acked >= 2 * 3 * 2  # two pushes a worker at least, on both shards
    if name in TAKEOVER:
        assert r.takeovers == [0, 1], r.line()
    if name == "bridge":  # etcd saw both sides: each primary kept its lease and went on without its backup
        assert r.takeovers == [0, 0], r.line()
