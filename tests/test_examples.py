"""The digits example trains to the issue's accuracy with each server-side optimizer."""

import pytest

from shardps.examples.digits import evaluate, train_worker
from tests.helpers import run_workers

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast


@pytest.mark.parametrize("optimizer", ["adafactor", "sm3"])
def test_digits_with_memory_efficient_optimizers(cluster2, optimizer):
    run_workers(lambda k: train_worker(cluster2.addresses, k, 2, sync="bsp", optimizer=optimizer, epochs=10), 2,
                timeout=240)
    acc = evaluate(cluster2.addresses)
    assert acc >= 0.93, (optimizer, acc)
