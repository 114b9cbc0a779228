"""A real Ray cluster on this machine: a head and more nodes on free ports, stopped exactly.

For tests, the benchmarks and trying shardps on Ray without a cluster::

    with RayLocalCluster(num_cpus=4) as rc:          # ray start --head on free ports
        rc.add_node(num_cpus=2, resources={"ps": 1})  # a second node, same machine
        ray.init(address=rc.address)                  # (rc.env holds what ray init and job clients need)

Ray 2.60 turns token authentication on: every ``ray`` command, node, driver
and job client of one cluster must carry the same ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN``; ``env`` holds them (a fresh random token per cluster)
and ``start`` puts them into this process's environment too, for
``ray.init``. ``node_env`` adds to every node's environment, which the
nodes' worker processes inherit (a ``PYTHONPATH`` for the actors' code:
cheaper than a driver's ``runtime_env``, docs/ray.md). Each node is started
in its own process group and lives under its own ``--temp-dir``; ``stop()``
ends exactly those process groups (never ``ray stop``, which stops every Ray
process of the machine) and removes the directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from shardps.deploy.local import wait_gone

TEMP_PREFIX = "shardps-ray-"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: bound all at once, since one bound and closed after another can be
    handed out again (seen: a node's agent and node manager given the same port, and ray start refused)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_command(python: str | None = None) -> list[str]:
    """The ``ray`` command of ``python`` (default this one; a venv's, not whatever ``ray`` is first on PATH)."""
    return [python or sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class _Node:
    pgid: int
    args: list[str]
    output: str = ""
    pids: list[int] = field(default_factory=list)


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _reload_auth_config() -> None:
    """Ray reads RAY_AUTH_MODE/RAY_AUTH_TOKEN when it is imported: have it read them again (a driver in
    this process that imported ray before the cluster was started). Best effort: setting them before
    ``import ray`` is the documented way."""
    import sys as _sys

    if "ray" not in _sys.modules:
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray version: the variables must come first
        pass


# A head's gcs_server, raylet and agents do not end on SIGTERM alone (measured here: still running after
# 10 s, while a worker node's processes end within 0.1 s); nothing of a cluster started here outlives it
# (its temp dir is removed), so they get 2 s before SIGKILL.
STOP_GRACE_S = 2.0


class RayLocalCluster:
    """``ray start`` on this machine, a head and optional more nodes, each on free ports."""

    def __init__(self, num_cpus: int = 2, *, resources: dict[str, float] | None = None,
                 token: str | None = None, start_timeout: float = 120.0,
                 object_store_bytes: int = 500 * 2**20, python: str | None = None,
                 node_env: dict[str, str] | None = None, log_monitor: bool = True) -> None:
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self.token = token or os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)
        self.start_timeout = start_timeout
        self.object_store_bytes = object_store_bytes
        # Unix socket paths are short (108 bytes): a short directory under /tmp.
        self.temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
        Path(self.temp_dir, "owner").write_text(str(os.getpid()))  # stop_stale() ends it once we are gone
        self.python = python or sys.executable  # the nodes' Python: its Ray, its packages
        # More environment for every node's processes; their worker processes inherit it. PYTHONPATH here
        # adds nothing to a worker's start, where a driver's runtime_env={"env_vars": ...} starts each
        # worker through Ray's setup_worker.py: one more Python and Ray import a worker (docs/ray.md).
        self.node_env = dict(node_env or {})
        # Each node's log monitor reads every worker's log files and sends their lines to the drivers that print
        # them (``log_to_driver``); a cluster whose drivers print nothing of their workers can do without it.
        self.log_monitor = log_monitor
        self.port = 0
        self.dashboard_port = 0
        self.nodes: list[_Node] = []
        self._saved_env: dict[str, str | None] = {}

    @property
    def env(self) -> dict[str, str]:
        """What every ray command, driver and job client of this cluster needs."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0"}

    @property
    def address(self) -> str:
        """The GCS address, for ``ray.init(address=...)`` and ``ray start --address``."""
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """For ``ray job submit --address`` and ``JobSubmissionClient``."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    @staticmethod
    def _node_ports() -> list[str]:
        """Free ports for a node's agents: their defaults (52365, ...) clash with any other Ray node
        or cluster on the machine, and the agent then never comes up."""
        flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port")
        out = []
        for flag, port in zip(flags, free_ports(len(flags))):
            out += [flag, str(port)]
        return out

    def _monitor_flag(self) -> list[str]:
        return [] if self.log_monitor else ["--include-log-monitor", "false"]

    def _ray_start(self, args: list[str]) -> _Node:
        env = {**os.environ, **self.node_env, **self.env}  # the cluster's own token wins
        # As an activated venv would: job entrypoints (`shardps ray`) find this Python's scripts.
        env["PATH"] = f"{Path(self.python).parent}{os.pathsep}{env.get('PATH', '')}"
        proc = subprocess.Popen(ray_command(self.python) + ["start", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
        node = _Node(proc.pid, args)
        self.nodes.append(node)  # stopped by stop() whatever happens next
        try:
            node.output, _ = proc.communicate(timeout=self.start_timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"ray start {' '.join(args)} did not finish within {self.start_timeout:.0f}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed ({proc.returncode}):\n{node.output[-3000:]}")
        return node

    def start(self) -> RayLocalCluster:
        """Start the head node (about 5-15 s).

        Its ports are free when chosen, but another process may take one before ``ray start`` binds it
        (any outgoing connection is given a port of the same range): a start that fails is stopped and
        tried once more on fresh ports; a second failure is raised with Ray's output.
        """
        for key, value in self.env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        _reload_auth_config()
        try:
            def head() -> list[str]:
                self.port, self.dashboard_port, client_port = free_ports(3)
                args = ["--head", "--port", str(self.port), "--dashboard-port", str(self.dashboard_port),
                        "--dashboard-host", "127.0.0.1", "--num-cpus", str(self.num_cpus),
                        "--temp-dir", self.temp_dir, "--disable-usage-stats",
                        "--object-store-memory", str(self.object_store_bytes), "--include-dashboard", "true",
                        "--ray-client-server-port", str(client_port), *self._node_ports(), *self._monitor_flag()]
                return args + (["--resources", json.dumps(self.resources)] if self.resources else [])

            self._start_twice(head, "ray start")
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_jobs(self, timeout: float = 120.0) -> None:
        """Block until the head accepts job submissions (its job agent starts a while after ``ray start``
        returns; until then ``ray job submit`` fails with "No available agent to submit job")."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:  # the client's constructor already asks the dashboard, which may not listen yet
                client = JobSubmissionClient(self.dashboard_url)
                job = client.submit_job(entrypoint="true")
            except (RuntimeError, OSError) as e:  # the dashboard or its job agent is not up yet (500, refused)
                last = e
                time.sleep(0.5)  # another process starting: nothing to wait on here
                continue
            while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a trivial job did not finish within {timeout:.0f}s")
                time.sleep(0.2)  # another process's job
            return
        raise TimeoutError(f"the head did not accept jobs within {timeout:.0f}s: {last}")

    def add_node(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> None:
        """Start one more node on this machine, joined to the head. A start that fails (a port taken meanwhile,
        as for the head; or, on a machine loaded to the full, Ray's own deadline for the node's registration
        with the head, "Failed to get node info") is stopped and tried once more on fresh ports; a second
        failure is raised with Ray's output."""
        def node() -> list[str]:
            # Its own directory: nodes that share one (their runtime_resources) delete each other's
            # unpacked job files, a running job's working_dir among them.
            node_dir = tempfile.mkdtemp(prefix="n", dir=self.temp_dir)
            args = ["--address", self.address, "--num-cpus", str(num_cpus), "--disable-usage-stats",
                    "--object-store-memory", str(self.object_store_bytes), "--temp-dir", node_dir,
                    *self._node_ports(), *self._monitor_flag()]
            return args + (["--resources", json.dumps(resources)] if resources else [])

        self._start_twice(node, "ray start of a node")

    def _start_twice(self, args: Callable[[], list[str]], what: str) -> None:
        """``ray start`` with ``args()`` (fresh ports each call); where it fails, that node is stopped and
        started once more; a second failure is raised with Ray's output."""
        for attempt in (1, 2):
            listed = len(self.nodes)
            try:
                self._ray_start(args())
                return
            except RuntimeError as e:
                if attempt == 2:
                    raise
                print(f"shardps: {what} failed, trying again on other ports: {str(e)[-500:]}",
                      file=sys.stderr, flush=True)
                failed, self.nodes = self.nodes[listed:], self.nodes[:listed]  # (``_ray_start`` lists it)
                for n in failed:
                    self._stop_node(n)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """End every process of the nodes started here (SIGTERM, then SIGKILL after ``grace`` s), newest node
        first."""
        self._stop_nodes(grace)
        # Worker processes run in their own sessions: they exit once their raylet is gone.
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def _stop_nodes(self, grace: float = STOP_GRACE_S) -> None:
        for node in reversed(self.nodes):
            self._stop_node(node, grace)
        self.nodes = []

    @staticmethod
    def _stop_node(node: _Node, grace: float = STOP_GRACE_S) -> None:
        """End ``node``'s process group: SIGTERM, then SIGKILL after ``grace`` s."""
        members = _group_members(node.pgid)
        if members:
            try:
                os.killpg(node.pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if wait_gone(members, grace):
                try:
                    os.killpg(node.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_gone(members, grace)

    def __enter__(self) -> RayLocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()



def stop_stale(grace: float = STOP_GRACE_S) -> list[str]:
    """End the clusters of ``RayLocalCluster``s whose owning process is gone (a killed test run, say).

    Finds each node's processes by its ``--temp-dir`` on their command line
    (GCS, raylet, dashboard, agents) and ends their process groups; Ray
    worker processes exit with their raylet. Returns the directories cleaned.
    """
    cleaned = []
    for d in sorted(Path("/tmp").glob(f"{TEMP_PREFIX}*")):
        try:
            owner = int((d / "owner").read_text())
            os.kill(owner, 0)
            continue  # its owner is alive: not stale
        except (OSError, ValueError):
            pass
        marker = str(d).encode()
        groups: set[int] = set()
        members: list[int] = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker in f.read():
                        groups.add(os.getpgid(int(pid)))
                        members.append(int(pid))
            except OSError:
                continue
        for pgid in groups:
            members += _group_members(pgid)
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if wait_gone(members, grace):
            for pgid in groups:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            wait_gone(members, grace)
        shutil.rmtree(d, ignore_errors=True)
        cleaned.append(str(d))
    return cleaned

