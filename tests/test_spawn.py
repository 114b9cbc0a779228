"""The fork server (deploy/spawn.py): forked ``shardps`` processes behave as freshly started ones."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardps.deploy import spawn as sp
from shardps.deploy.lifeline import Lifeline
from shardps.deploy.local import parse_ready, read_ready, stop_processes, wait_gone
from shardps.protos import env
from shardps.server.app import READY_PREFIX
from tests.helpers import kill_left

pytestmark = pytest.mark.cluster  # processes: not in make test-fast


@pytest.fixture(scope="module")
def spawner():
    s = sp.Spawner().start()
    yield s
    s.close()


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", **extra)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return " ".join(f.read().replace(b"\0", b" ").decode().split())


def test_a_forked_server_serves_shows_its_command_line_and_exits_0_on_sigterm(spawner):
    proc = spawner.popen(["server", "--port", "0"], env=_env(SHARDPS_SHARD_INDEX="1", SHARDPS_NUM_SHARDS="3"))
    try:
        ready = read_ready(proc, 60)
        assert parse_ready(ready)[0].startswith("127.0.0.1:")
        assert ready.endswith("(shard 1 of 3)")  # from its environment, not the fork server's
        assert _cmdline(proc.pid) == f"{sys.executable} -m shardps server --port 0"
        assert os.getsid(proc.pid) == proc.pid  # a session of its own
        assert proc.poll() is None
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        stop_processes([proc])


def test_exit_codes_are_the_childs_a_usage_error_2_and_sigkill_minus_9(spawner):
    bad = spawner.popen(["server", "--port", "nope"], env=_env())
    out, _ = bad.communicate(timeout=60)
    assert (out, bad.returncode) == ("", 2)
    proc = spawner.popen(["server", "--port", "0"], env=_env())
    read_ready(proc, 60)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.kill()  # a second signal to an ended child goes nowhere (its pid may be another's by now)


def test_a_childs_stderr_can_be_a_file_of_the_callers_which_stays_open(spawner, tmp_path):
    with open(tmp_path / "log", "w") as log:
        bad = spawner.popen(["server", "--port", "nope"], env=_env(), stderr=log)
        assert bad.wait(timeout=60) == 2 and bad.stderr is None
        assert not log.closed
        log.write("after\n")
    text = (tmp_path / "log").read_text()
    assert "--port" in text and "invalid" in text and text.endswith("after\n")


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def test_communicate_times_out_and_can_be_called_again(spawner):
    proc = spawner.popen(["server", "--port", "0"], env=_env())
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=0.2)  # a server runs until it is stopped
        # SIGTERM only once the server handles it: from then on it prints its ready line and exits 0 when
        # stopped (before, the signal's default action ends it, as it should, with nothing printed). The
        # handler cannot be waited on, so its mask is polled, with a deadline.
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGTERM):
            assert time.monotonic() < deadline, "the server never installed its SIGTERM handler"
            time.sleep(0.01)
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        assert out.startswith(READY_PREFIX) and proc.returncode == 0
    finally:
        stop_processes([proc])


def test_a_forked_child_stops_when_its_lifeline_breaks(spawner):
    line = Lifeline()
    proc = spawner.popen(["server", "--port", "0"], env=_env(), lifeline_fd=line.read_fd)
    try:
        read_ready(proc, 60)
        line.close()  # what the kernel does when the parent dies, however it dies
        assert proc.wait(timeout=60) == 0  # stopped as on SIGTERM
    finally:
        line.close()
        stop_processes([proc])


def test_spawn_falls_back_to_a_fresh_process_where_a_fork_would_differ(monkeypatch):
    env = _env()
    env["OMP_NUM_THREADS"] = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)  # read when torch loads
    assert sp.import_time_env(env) != sp.import_time_env(os.environ)
    proc = sp.spawn(["server", "--port", "0"], env=env)
    try:
        assert isinstance(proc, subprocess.Popen)
        read_ready(proc, 60)
    finally:
        stop_processes([proc])
    monkeypatch.setenv("SHARDPS_FORK", "0")
    assert sp.spawner() is None
    proc = sp.spawn(["server", "--port", "0"], env=_env())
    try:
        assert isinstance(proc, subprocess.Popen)
    finally:
        stop_processes([proc])


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)


def test_shardps_processes_start_with_openmp_threads_that_sleep_when_idle_unless_the_user_says(monkeypatch):
    """Where the environment says nothing of how OpenMP's idle threads wait, a process shardps starts (the fork
    server, whose torch its children share; a fresh child; the ``shardps`` command itself) has
    ``OMP_WAIT_POLICY=PASSIVE``; a user's setting is kept."""
    clean = {k: v for k, v in _env().items() if k not in env.OPENMP_KNOBS}
    assert env.openmp_defaults(clean) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert all(env.openmp_defaults({**clean, knob: "1"}) == {} for knob in env.OPENMP_KNOBS)
    assert sp.Spawner(clean).environ["OMP_WAIT_POLICY"] == "PASSIVE"  # what the fork server starts with
    mine = sp.Spawner({**clean, "GOMP_SPINCOUNT": "1000"}).environ
    assert mine["GOMP_SPINCOUNT"] == "1000" and "OMP_WAIT_POLICY" not in mine
    said = textwrap.dedent("""
        import os
        from shardps import cli
        try:
            cli.main(["health", "--help"])  # the command's start, torch not imported
        except SystemExit:
            pass
        print("OMP=" + os.environ.get("OMP_WAIT_POLICY", "-"))
    """)
    for extra, want in (({}, "OMP=PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "OMP=ACTIVE"),
                        ({"GOMP_SPINCOUNT": "1000"}, "OMP=-")):
        out = subprocess.run([sys.executable, "-c", said], env={**clean, **extra}, capture_output=True, text=True,
                             timeout=60, check=True).stdout
        assert out.splitlines()[-1] == want, (extra, out)
    # A fork server this test process started earlier may hold another environment (a test's variable, set
    # then): its children would start fresh, rightly. This one starts its own, with this environment.
    monkeypatch.setattr(sp, "_shared", None)
    try:
        proc = sp.spawn(["server", "--port", "0"], env=_env())  # the default does not keep children from a fork
        try:
            assert isinstance(proc, sp.ForkedProcess)
        finally:
            stop_processes([proc])
    finally:
        if sp._shared is not None:
            sp._shared.close()
    monkeypatch.setenv("SHARDPS_FORK", "0")
    proc = sp.spawn(["server", "--port", "0"], env=clean)  # fresh: its own environment
    try:
        assert isinstance(proc, subprocess.Popen)
        read_ready(proc, 60)
        assert _environ(proc.pid).get("OMP_WAIT_POLICY") == "PASSIVE"
    finally:
        stop_processes([proc])


def test_what_python_reads_at_run_time_does_not_keep_a_child_from_being_forked():
    base = _env()
    for var in sp.RUN_TIME:  # PYTHONBREAKPOINT: set by ray.init in its driver's environment
        assert sp.import_time_env({**base, var: "x"}) == sp.import_time_env(base), var
    assert sp.import_time_env({**base, "PYTHONHASHSEED": "1"}) != sp.import_time_env(base)


def test_the_fork_server_ends_with_its_caller_and_the_children_with_their_lifelines(tmp_path):
    """SIGKILL the caller: the fork server reads EOF and exits; its child sees the lifeline break."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        from shardps.deploy.lifeline import Lifeline
        from shardps.deploy.local import read_ready
        from shardps.deploy.spawn import spawner
        line = Lifeline()
        sp = spawner()
        proc = sp.popen(["server", "--port", "0"], env=dict(os.environ), lifeline_fd=line.read_fd)
        read_ready(proc, 60)
        print(sp.pid, proc.pid, flush=True)
        sys.stdin.read()  # until the test kills this process
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    pids: list[int] = []
    try:
        assert caller.stdout is not None
        pids = [int(x) for x in caller.stdout.readline().split()]
        assert len(pids) == 2, pids
        assert "shardps.forkserver" in _cmdline(pids[0])
        caller.kill()
        caller.wait(timeout=30)
        assert wait_gone(pids, timeout=60) == []
    finally:
        kill_left(caller, lambda: pids)
