"""RayLocalCluster's start-up waits and retries, without starting Ray (the clusters themselves: test_ray.py).

Regression for a setup error of the session's Ray cluster, seen once in a quiet run of the fault tests
(at test_ray.py::test_kill_9_a_server_actor_its_backup_takes_over_and_the_result_is_exact): the job client's
constructor already asks the dashboard, which may not listen yet when ``ray start`` returns, and a port
chosen free may be taken before ``ray start`` binds it. Both are now retried, and so is a node's start
(``add_node``), which failed once in a full suite beside a stress run: Ray's deadline for the node's
registration with the head.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardps.deploy.ray import local


class _Client:
    """A job client whose dashboard refuses ``refusals`` connections first."""

    refusals = 0
    made = 0

    def __init__(self, url: str) -> None:
        type(self).made += 1
        if type(self).made <= type(self).refusals:
            raise ConnectionError(f"Failed to connect to Ray at address: {url}.")

    def submit_job(self, entrypoint: str) -> str:
        return "job"

    def get_job_status(self, job: str) -> object:
        from ray.job_submission import JobStatus

        return JobStatus.SUCCEEDED


def test_wait_for_jobs_retries_a_dashboard_that_does_not_listen_yet(monkeypatch, tmp_path):
    import ray.job_submission

    monkeypatch.setattr(_Client, "refusals", 2)
    monkeypatch.setattr(_Client, "made", 0)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", _Client)
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    rc = local.RayLocalCluster()
    try:
        rc.wait_for_jobs(timeout=30)
        assert _Client.made == 3
    finally:
        rc.stop()


def test_a_head_that_fails_to_start_is_tried_once_more_on_other_ports(monkeypatch):
    starts: list[list[str]] = []

    def ray_start(self, args):
        starts.append(args)
        if len(starts) == 1:
            raise RuntimeError("ray start --head ... failed (1): address already in use")
        return local._Node(0, args)

    monkeypatch.setattr(local.RayLocalCluster, "_ray_start", ray_start)
    rc = local.RayLocalCluster().start()
    try:
        assert len(starts) == 2
        assert starts[1][starts[1].index("--port") + 1] == str(rc.port)
    finally:
        rc.nodes = []
        rc.stop()


def test_a_head_that_fails_twice_says_why(monkeypatch):
    def ray_start(self, args):
        raise RuntimeError("ray start --head ... failed (1): no")

    monkeypatch.setattr(local.RayLocalCluster, "_ray_start", ray_start)
    with pytest.raises(RuntimeError, match="failed"):
        local.RayLocalCluster().start()


def test_node_env_reaches_every_ray_start_and_cannot_override_the_auth_token(monkeypatch):
    """The session cluster gives its actors the repository's path this way (tests/conftest.py): every node's
    ``ray start`` gets ``node_env``, and the cluster's own token wins over one in ``node_env``."""
    envs: list[dict[str, str]] = []

    class _Popen:
        pid = 0
        returncode = 0

        def __init__(self, cmd, **kw):
            envs.append(kw["env"])

        def communicate(self, timeout=None):
            return "", None

    monkeypatch.setattr(local.subprocess, "Popen", _Popen)
    rc = local.RayLocalCluster(node_env={"PYTHONPATH": "/code", "RAY_AUTH_TOKEN": "not-this"})
    try:
        rc.start()
        rc.add_node()
        assert len(envs) == 2
        assert all(e["PYTHONPATH"] == "/code" and e["RAY_AUTH_TOKEN"] == rc.token != "not-this" for e in envs)
    finally:
        rc.nodes = []
        rc.stop()


def test_a_node_whose_start_fails_is_stopped_and_started_once_more_on_other_ports(monkeypatch, capsys):
    """``add_node``'s first ``ray start`` fails (Ray's deadline for the node's registration, on a machine loaded
    to the full): that node is stopped and forgotten, and one more start on fresh ports joins; a second failure
    is raised with Ray's output."""
    no_such_group = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process in it: nothing to stop
    starts: list[list[str]] = []
    fail: set[int] = {2}  # the head is start 1

    class _Popen:
        def __init__(self, cmd, **kw):
            starts.append(cmd)
            self.pid = no_such_group
            self.returncode = 1 if len(starts) in fail else 0

        def communicate(self, timeout=None):
            return ("Failed to get node info b'RPC error: Deadline Exceeded'" if self.returncode else ""), None

    monkeypatch.setattr(local.subprocess, "Popen", _Popen)
    rc = local.RayLocalCluster()
    try:
        rc.start()
        rc.add_node()
        assert len(starts) == 3 and len(rc.nodes) == 2  # the head and the node that joined
        first, second = starts[1], starts[2]
        assert first[first.index("--node-manager-port") + 1] != second[second.index("--node-manager-port") + 1]
        assert "trying again on other ports" in capsys.readouterr().err
        fail.update({4, 5})
        with pytest.raises(RuntimeError, match="Failed to get node info"):
            rc.add_node()
        assert len(starts) == 5 and len(rc.nodes) == 3  # the second failure is listed: stop() ends it
    finally:
        rc.nodes = []
        rc.stop()
