"""The demo end to end: servers and workers as separate processes, as `make demo` runs it."""

import json
import subprocess
import sys


def run_demo(*args: str, timeout: float = 240) -> dict:
    proc = subprocess.run([sys.executable, "-m", "shardps", "demo", "--json", *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


def test_demo_bsp_default_flags():
    out = run_demo()
    assert out["sync"] == "bsp" and out["optimizer"] == "adam"
    assert out["test_accuracy"] >= 0.95, out
    assert out["steps"] == 440 and out["pushes_per_worker"] == 440
    assert out["seconds"] > 0


def test_demo_every_4_pushes_a_quarter():
    out = run_demo("--sync", "every:4", "--epochs", "8", "--quiet", "--workers", "2", "--servers", "1")
    assert out["sync"] == "every:4"
    assert out["pushes_per_worker"] * 4 == out["steps"] == 8 * 22
    assert out["test_accuracy"] >= 0.8, out


def test_demo_bad_flag_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "shardps", "demo", "--sync", "sometimes"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown sync mode 'sometimes'" in proc.stderr
