"""The MovieLens-100K example: rows on the servers train as one process does (needs recbole's wheel for the data)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(importlib.util.find_spec("recbole") is None,
                                 reason="the data ships in recbole's wheel: pip install --no-deps recbole==1.2.1")]


def test_movielens_rmse_equals_one_process():
    out = subprocess.run([sys.executable, "-m", "shardps.examples.movielens", "--epochs", "1", "--dim", "8", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout)
    assert abs(got["rmse"] - got["reference_rmse"]) < 0.005
    assert got["rmse"] < 1.2 and got["test"] == 10_000
