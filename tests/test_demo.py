"""The demo end to end: servers and workers as separate processes, as `make demo` runs it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import shardps
from shardps.deploy.local import wait_gone
from tests.helpers import kill_left

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast


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
    assert out["steps"] == 220 and out["pushes_per_worker"] == 220  # 10 epochs of 22 steps
    assert out["seconds"] > 0


def test_demo_every_4_pushes_a_quarter_and_plots(tmp_path):
    png = tmp_path / "run.png"
    out = run_demo("--sync", "every:4", "--epochs", "4", "--quiet", "--workers", "2", "--servers", "1",
                   "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert out["sync"] == "every:4"
    assert out["pushes_per_worker"] * 4 == out["steps"] == 4 * 22
    assert out["test_accuracy"] >= 0.8, out  # 0.867 after 4 epochs (2026-12-03)


def test_demo_bf16_on_the_wire_with_overlap():
    """Gradients up and weights down in bf16, buckets pushed during backward: still learns digits."""
    out = run_demo("--wire", "bf16", "--overlap", "--epochs", "4", "--quiet")
    assert out["steps"] == 4 * 22 and out["test_accuracy"] >= 0.9, out  # 0.950 after 4 epochs (2026-12-03)


def test_demo_gpt_streams_a_model_larger_than_its_budget():
    """`shardps demo --example gpt --stream`: the char-GPT (6.4 MB here) trained by one worker holding at
    most its budget of live parameter + gradient bytes (2 MiB), plus one unit (docs/streaming.md)."""
    out = run_demo("--example", "gpt", "--stream", "--max-live-mb", "2", "--dim", "256", "--layers", "2",
                   "--steps", "4", "--servers", "1", "--quiet")
    assert out["example"] == "gpt" and out["stream"] and out["steps"] == 4, out
    budget = 2 * 2**20
    assert out["model_bytes"] > 3 * budget, out
    assert 0 < out["peak_live_bytes"] <= budget + out["largest_unit_bytes"], out
    assert out["pulls_per_step"] > out["units"], out  # units pulled for forward and again for backward
    assert out["first_loss"] == out["first_loss"] and out["last_loss"] < 5.0, out  # finite, learning from ln 65


@pytest.mark.parametrize("flags, message", [
    (["--example", "digits", "--steps", "5"], "--steps does not apply to --example digits (it is the char-GPTs')"),
    (["--example", "digits", "--stream"], "--stream does not apply to --example digits (it is gpt's)"),
    (["--example", "moe", "--stream"], "--stream does not apply to --example moe (it is gpt's)"),
    (["--example", "moe", "--overlap"], "--overlap does not apply to --example moe (it is the digits example's)"),
    (["--example", "moe", "--sync", "asp"], "--example moe trains with --sync bsp, got asp"),
    (["--experts", "4"], "--experts does not apply to --example gpt (it is moe's)"),
    (["--workers", "2"], "--example gpt trains with one worker (this process), got --workers 2"),
    (["--overlap"], "--overlap does not apply to --example gpt (it is the digits example's)"),
    (["--epochs", "3"], "--epochs does not apply to --example gpt"),
    (["--sync", "asp"], "--example gpt has one worker: its sync is bsp, got --sync asp"),
    (["--stream", "--max-live-mb", "0"], "--max-live-mb must be > 0, got 0"),
    (["--dim", "100"], "--dim must be a multiple of the model's 8 heads, got 100"),
    (["--example", "movielens", "--workers", "2"], "--example movielens trains with one worker (this process), "
                                                   "got --workers 2"),
    (["--example", "movielens", "--steps", "5"], "--steps does not apply to --example movielens (it is the "
                                                 "char-GPTs')"),
    (["--example", "movielens", "--seed", "1"], "--seed does not apply to --example movielens (it is the digits "
                                                "example's (the split and the init are fixed))"),
    (["--example", "movielens", "--stream"], "--stream does not apply to --example movielens (it is gpt's)"),
    (["--example", "movielens", "--optimizer", "sgd"], "--example movielens trains with --optimizer adam, got sgd"),
    (["--example", "movielens", "--lr", "0"], "--lr must be > 0, got 0"),
    (["--example", "movielens", "--dim", "0"], "--dim must be >= 1, got 0"),
])
def test_demo_examples_refuse_what_does_not_apply_before_starting_anything(flags, message, capsys):
    from shardps.cli import main

    assert main(["demo", "--example", "gpt", *flags]) == 2  # a later --example wins
    assert message in capsys.readouterr().err


def test_demo_bad_flag_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "shardps", "demo", "--sync", "sometimes"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown sync mode 'sometimes'" in proc.stderr


def _marked(mark: str) -> list[int]:
    """PIDs of the processes whose environment holds ``mark`` (a demo and everything it started)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                continue
    return pids


def _kind(pid: int) -> str:
    """What a process the demo started is, from its command line: server, worker or fork server."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        words = f.read().replace(b"\0", b" ").decode().split()
    if "shardps.forkserver" in words:
        return "fork server"
    return words[words.index("shardps") + 1]


def _start_demo(mark: str) -> tuple[subprocess.Popen, list[str], threading.Thread, threading.Condition]:
    """The demo with a marker in its environment; its stderr is drained (a full pipe would block it).

    It starts with SIGINT ignored, as a background job of a shell without job control does (found by
    the stress run: Python then leaves SIGINT ignored, and the demo did not answer it).
    """
    launch = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "os.execv(sys.executable, [sys.executable, '-m', 'shardps', 'demo', '--epochs', '200'])")
    proc = subprocess.Popen([sys.executable, "-c", launch],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TEST_DEMO_MARK=mark))
    lines: list[str] = []
    seen = threading.Condition()

    def drain() -> None:
        for line in proc.stderr:
            with seen:
                lines.append(line)
                seen.notify_all()
        with seen:
            lines.append("")  # EOF
            seen.notify_all()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return proc, lines, t, seen


def _wait_line(lines, seen, prefix: str, timeout: float = 120) -> str:
    with seen:
        assert seen.wait_for(lambda: any(ln.startswith(prefix) or ln == "" for ln in lines), timeout), prefix
        line = next(ln for ln in lines if ln.startswith(prefix) or ln == "")
    assert line, f"the demo ended before printing {prefix!r}: {''.join(lines)[-2000:]}"
    return line


def _wait_registered(addresses: list[str]) -> None:
    with shardps.connect(addresses) as client:  # wait until the workers have registered
        deadline = time.monotonic() + 120
        while not all(s["registered_workers"] == [0, 1] for s in client.stats()):
            assert time.monotonic() < deadline, "workers never registered"
            time.sleep(0.1)  # polling a remote state: nothing to wait on locally


@pytest.mark.fault
@pytest.mark.parametrize("sig, phase", [(signal.SIGINT, "training"), (signal.SIGTERM, "starting")],
                         ids=["SIGINT-training", "SIGTERM-starting"])
def test_demo_interrupted_stops_everything_it_started(sig, phase):
    """Ctrl-C while it trains, and SIGTERM while its servers start: one handler ends both signals, so
    each phase once (both signals in both phases took four demo start-ups of the suite's time)."""
    mark = f"demo-{uuid.uuid4()}"
    proc, lines, drain, seen = _start_demo(mark)
    try:
        if phase == "starting":  # while its servers start
            _wait_line(lines, seen, "shardps demo: ")
        else:
            line = _wait_line(lines, seen, "servers up at ")
            _wait_registered(line[len("servers up at "):].strip().split(", "))
        children = [p for p in _marked(mark) if p != proc.pid]
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
        drain.join(timeout=30)
        assert "interrupted" in "".join(lines)
        assert wait_gone(children + _marked(mark), timeout=30) == []  # servers and workers gone
    finally:
        kill_left(proc, lambda: _marked(mark))


@pytest.mark.fault
def test_a_sigkilled_demo_takes_its_servers_and_workers_with_it():
    """SIGKILL gives the demo no chance to clean up: its children see their lifeline break and stop."""
    mark = f"demo-{uuid.uuid4()}"
    proc, lines, drain, seen = _start_demo(mark)
    try:
        line = _wait_line(lines, seen, "servers up at ")
        _wait_registered(line[len("servers up at "):].strip().split(", "))
        children = [p for p in _marked(mark) if p != proc.pid]
        kinds = sorted(_kind(p) for p in children)
        # two servers, two workers, and the fork server they were forked from (deploy/spawn.py)
        forked = os.environ.get("SHARDPS_FORK", "1") != "0"
        assert kinds == ["fork server"] * forked + ["server", "server", "worker", "worker"], kinds
        proc.kill()
        proc.wait(timeout=30)
        assert wait_gone(children, timeout=45) == []
    finally:
        kill_left(proc, lambda: _marked(mark))
