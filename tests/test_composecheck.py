"""deploy/composecheck.py's pure parts: the compose file's services as it reads them, Docker's timestamps and
health log, a worker's summary line. The check itself needs root and Docker: ``make compose-check``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardps.deploy.composecheck import docker_time, healthy_after, last_json, services, summary

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_services_of_the_compose_file():
    svc = services(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()))
    roles = {n: (s.role, s.built, s.profiles) for n, s in svc.items()}
    assert roles["server0"] == ("server", True, ()) and roles["worker1"] == ("worker", True, ())
    assert roles["etcd"] == ("etcd", True, ()) and roles["gpu-worker0"] == ("worker", True, ("gpu",))
    assert roles["prometheus"] == ("prometheus", False, ()) and svc["prometheus"].host_ports == (9090,)
    assert svc["server0"].environment["SHARDPS_REPLICA_TARGET"] == "server1:7100"
    # docker-compose config renders ports as mappings
    assert services({"services": {"p": {"image": "x", "ports": [{"published": 9090, "target": 9090}]}}})[
        "p"].host_ports == (9090,)


def test_docker_time_and_healthy_after():
    assert docker_time("2026-12-05T22:35:42.124009337Z") == pytest.approx(docker_time("2026-12-05T22:35:42Z")
                                                                           + 0.124009337)
    assert docker_time("2026-12-05T23:35:42+01:00") == docker_time("2026-12-05T22:35:42Z")
    with pytest.raises(ValueError):
        docker_time("yesterday")
    state = {"StartedAt": "2026-12-05T10:00:00.5Z", "Health": {"Status": "healthy", "Log": [
        {"Start": "2026-12-05T09:59:50Z", "End": "2026-12-05T09:59:51Z", "ExitCode": 0},  # an earlier start's
        {"Start": "2026-12-05T10:00:10.5Z", "End": "2026-12-05T10:00:11Z", "ExitCode": 1},
        {"Start": "2026-12-05T10:00:20.5Z", "End": "2026-12-05T10:00:21.25Z", "ExitCode": 0},
        {"Start": "2026-12-05T10:00:30.5Z", "End": "2026-12-05T10:00:31Z", "ExitCode": 0}]}}
    assert healthy_after(state) == pytest.approx(20.75)
    assert healthy_after({"StartedAt": "2026-12-05T10:00:00Z", "Health": {"Log": []}}) is None


def test_last_json_is_the_workers_summary_line():
    assert last_json('log line\n{"final_loss": 0.1, "steps": 3}\n\n') == {"final_loss": 0.1, "steps": 3}
    assert last_json('{"final_loss": 0.1}\nTraceback: boom') is None
    assert last_json("") is None and last_json("[1, 2]") is None
    assert summary([("a", "PASS", "1 s")]).splitlines()[-1] == "| a | PASS | 1 s |"
