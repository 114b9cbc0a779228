"""The MovieLens-100K example: rows on the servers train as one process does (the data ships in recbole's wheel,
which ``make venv`` installs: pip install --no-deps recbole==1.2.1)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from shardps.cli import main
from shardps.examples import movielens

needs_data = pytest.mark.skipif(importlib.util.find_spec("recbole") is None,
                                reason="the data ships in recbole's wheel: pip install --no-deps recbole==1.2.1")


@pytest.mark.cluster
@needs_data
def test_demo_movielens_rmse_equals_one_process(capsys):
    """``shardps demo --example movielens --json``: the test RMSE of the tables on 2 servers and of the same model
    in one process (one epoch of 18 batches of 5,000 ratings: a few seconds)."""
    assert main(["demo", "--example", "movielens", "--epochs", "1", "--batch-size", "5000", "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out.splitlines()[-1])
    assert abs(got["rmse"] - got["reference_rmse"]) < 0.005
    assert 0.5 < got["rmse"] < 1.2  # the ratings' std is 1.13: it learnt something
    assert (got["example"], got["train"], got["test"], got["epochs"], got["batch"]) == ("movielens", 90_000, 10_000,
                                                                                        1, 5000)
    assert "test RMSE" in out.err


def test_demo_movielens_without_the_data_says_how_to_get_it(monkeypatch, capsys):
    def missing(given: str | None) -> None:
        raise FileNotFoundError("MovieLens-100K not found: `pip install --no-deps recbole==1.2.1`")

    monkeypatch.setattr(movielens, "data_dir", missing)
    assert main(["demo", "--example", "movielens", "--json"]) == 1
    out = capsys.readouterr()
    assert "pip install --no-deps recbole==1.2.1" in out.err and out.out == ""
