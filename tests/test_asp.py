"""ASP on the digits data converges and records real staleness."""

import shardps
from shardps.examples.digits import evaluate, train_worker
from tests.helpers import run_workers


def test_asp_digits_converges_with_stale_gradients(cluster2):
    results = run_workers(
        lambda k: train_worker(cluster2.addresses, k, 2, sync="asp", epochs=8, seed=0), 2, timeout=240)
    acc = evaluate(cluster2.addresses)
    assert acc >= 0.9, acc
    assert all(r["pushes"] == r["steps"] for r in results)
    with shardps.connect(cluster2.addresses) as client:
        stats = client.stats()
    for s in stats:
        counts = s["staleness_counts"]
        total = sum(counts.values())
        assert total == s["gradients_applied_total"] == sum(r["pushes"] for r in results)
        assert sum(n for st, n in counts.items() if st > 0) > 0, counts  # some gradients were stale
        assert s["version"] == total  # ASP: one version per gradient
