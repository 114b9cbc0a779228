"""tests/cpu.py, the plugin that says where the suite's CPU goes: it counts and it refuses to run beside
other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUSY = """
import time

def test_busy():
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass

def test_idle():
    pass
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_some.py").write_text(BUSY)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu", "-p", "no:cacheprovider",
                           *args, str(tmp_path / "test_some.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_each_test_gets_the_machines_cpu_seconds_and_a_summary(tmp_path):
    p = _pytest(tmp_path, "-p", "no:xdist", "--cpu-out", str(tmp_path / "cpu.jsonl"))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["id"].split("::")[-1]: r for r in map(json.loads, (tmp_path / "cpu.jsonl").read_text().splitlines())}
    assert rows.keys() == {"test_busy", "test_idle"}
    assert rows["test_busy"]["cpu_s"] >= 0.25 and rows["test_busy"]["wall_s"] >= 0.25, rows
    assert "CPU seconds (the whole machine's, per test)" in p.stdout and "test_some.py::test_busy" in p.stdout


def test_beside_other_tests_it_refuses(tmp_path):
    p = _pytest(tmp_path, "-n", "2")
    assert p.returncode != 0 and "run it in one process" in p.stdout + p.stderr
