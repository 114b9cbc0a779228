"""The shipped deployment files: compose, Prometheus scrape config, Grafana provisioning."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose is not installed (`make test` installs Debian's as root)")
def test_compose_file_is_valid_and_wires_servers_workers_prometheus_grafana():
    out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "--services"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"server0", "server1", "worker0", "worker1", "prometheus", "grafana"}
    full = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, timeout=60).stdout
    assert "--addresses" in full and "server0:7000,server1:7000" in full


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (it comes with Debian's prometheus, which `make test` "
                           "installs with apt as root)")
def test_prometheus_config_is_valid():
    out = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _compose_services() -> dict[str, str]:
    """Service name -> its block of text in the compose file (two-space indented keys)."""
    text = (DEPLOY / "docker-compose.yml").read_text().split("\nservices:\n", 1)[1]
    parts = re.split(r"^  ([a-z0-9]+):\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_scrape_targets_are_the_compose_services_metrics_ports():
    prom = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    services = _compose_services()
    targets = re.findall(r'"([a-z0-9]+):(\d+)"', prom)
    assert sorted(t for t, _ in targets) == ["server0", "server1", "worker0", "worker1"]
    for service, port in targets:
        assert f'"--metrics-port", "{port}"' in services[service], service


def test_compose_servers_back_each_other_up():
    """--replicas 2: server i's --replica-target is server i+1's --replica-port; each advertises itself."""
    services = _compose_services()

    def flag(service: str, name: str) -> str:
        return re.search(rf'"{name}", "([^"]+)"', services[service]).group(1)

    servers = ["server0", "server1"]
    for i, s in enumerate(servers):
        nxt = servers[(i + 1) % 2]
        assert flag(s, "--replicas") == "2"
        assert flag(s, "--replica-target") == f"{nxt}:{flag(nxt, '--replica-port')}"
        assert flag(s, "--advertise-address") == f"{s}:{flag(s, '--port')}"


def test_grafana_provisioning_points_at_the_dashboards_and_datasource():
    ds = (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    uid = re.search(r"uid:\s*(\S+)", ds).group(1)
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        dash = json.loads(path.read_text())
        uids = {p["datasource"]["uid"] for p in dash["panels"]}
        assert uids == {uid}, path.name
    prov = (DEPLOY / "grafana" / "provisioning" / "dashboards" / "shardps.yml").read_text()
    mount = re.search(r"path:\s*(\S+)", prov).group(1)
    assert f"./grafana/dashboards:{mount}" in (DEPLOY / "docker-compose.yml").read_text()
