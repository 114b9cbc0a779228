"""The digits example trains to its target accuracy with each server-side optimizer."""

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


def test_a_worker_joining_a_complete_job_says_so_in_one_line(cluster2, capsys):
    """Regression: run again against servers that hold the job at its last step (compose's checkpoint volume,
    a second `up`), a worker exited 0 at once with `pushes: 0, final_loss: NaN` and no word of why."""
    first = train_worker(cluster2.addresses, 0, 1, sync="bsp", epochs=1)
    capsys.readouterr()
    again = train_worker(cluster2.addresses, 0, 1, sync="bsp", epochs=1)
    said = capsys.readouterr().err.strip().splitlines()
    assert first["already_complete"] is False and first["final_loss"] is not None
    assert again["already_complete"] is True and again["pushes"] == 0 and again["final_loss"] is None
    assert len(said) == 1 and said[0].startswith(f"shardps worker 0: the job is already complete: it is at step "
                                                 f"{first['steps']}, and this worker trains {first['steps']} steps")
    assert "To start a new job, start the servers on an empty --checkpoint-dir" in said[0]
