"""The demo end to end: servers and workers as separate processes, as `make demo` runs it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import shardps


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


def test_demo_every_4_pushes_a_quarter_and_plots(tmp_path):
    png = tmp_path / "run.png"
    out = run_demo("--sync", "every:4", "--epochs", "8", "--quiet", "--workers", "2", "--servers", "1",
                   "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert out["sync"] == "every:4"
    assert out["pushes_per_worker"] * 4 == out["steps"] == 8 * 22
    assert out["test_accuracy"] >= 0.8, out


def test_demo_bad_flag_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "shardps", "demo", "--sync", "sometimes"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown sync mode 'sometimes'" in proc.stderr


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_interrupted_stops_everything_it_started(sig):
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "demo", "--epochs", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addresses = None
        for line in proc.stderr:  # the demo reports its servers before starting the workers
            if line.startswith("servers up at "):
                addresses = line[len("servers up at "):].strip().split(", ")
                break
        assert addresses, "demo never reported its servers"
        with shardps.connect(addresses) as client:  # wait until the workers have registered
            deadline = time.monotonic() + 120
            while not all(s["registered_workers"] == [0, 1] for s in client.stats()):
                assert time.monotonic() < deadline, "workers never registered"
                time.sleep(0.1)  # polling a remote state: nothing to wait on locally
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
        assert "interrupted" in proc.stderr.read()
        assert _processes_mentioning(addresses[0]) == []  # workers gone
        for a in addresses:  # servers gone: nothing listens any more
            with pytest.raises(TimeoutError):
                shardps.connect([a], ready_timeout=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
