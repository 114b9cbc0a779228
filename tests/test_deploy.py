"""The shipped deployment files: compose, Dockerfile, Prometheus scrape config, Grafana provisioning.

No Docker engine runs on these machines, so the compose file is checked the
way it can be here: validated by docker-compose, read as YAML, and its
shardps services run as local processes with their own commands and
environments (service names mapped to loopback, ports made free): the
servers come up and turn healthy with the compose healthcheck, the workers
train, and every Prometheus target serves the metrics of its service.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardps.deploy.local import stop_processes
from shardps.protos import env
from shardps.server.coordinator import LocalEtcd
from tests.helpers import ETCD_MISSING, chosen_port

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SHARDPS = str(Path(sys.executable).parent / "shardps")
PORT_VARS = (env.PORT, env.REPLICA_PORT, env.METRICS_PORT)


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _shardps_services(profile: str | None = None) -> dict[str, dict[str, Any]]:
    """The services that run the shardps command from its image (of the default profile, or of ``profile``); not
    etcd, which runs another program of the same image."""
    out = {}
    for name, svc in _compose()["services"].items():
        if (str(svc.get("image", "")).startswith("shardps") and "entrypoint" not in svc
                and profile in (svc.get("profiles") or [None])):
            out[name] = svc
    return out


def _servers() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _shardps_services().items() if s["command"][0] == "server"}


def _workers(profile: str | None = None) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _shardps_services(profile).items() if s["command"][0] == "worker"}


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose is not installed (`make test` installs Debian's as root)")
def test_compose_file_is_valid_and_wires_servers_workers_prometheus_grafana():
    out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "--services"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"etcd", "server0", "server1", "worker0", "worker1", "gpu-worker0",
                                       "gpu-worker1", "prometheus", "grafana"}
    full = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, timeout=60).stdout
    assert "SHARDPS_ADDRESSES: server0:7000,server1:7000" in full and "condition: service_healthy" in full


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose is not installed (`make test` installs Debian's as root)")
def test_compose_passes_the_torch_index_and_version_from_the_environment():
    """compose 1.29 cannot pass a build argument to `up --build`: the build args read the environment."""
    def config(**env_vars: str) -> dict[str, Any]:
        environ = {k: v for k, v in os.environ.items() if not k.endswith(("TORCH_INDEX_URL", "TORCH_VERSION"))}
        out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "--profile", "gpu",
                              "config"], capture_output=True, text=True, timeout=60, env={**environ, **env_vars})
        assert out.returncode == 0, out.stderr
        return {n: s["build"]["args"] for n, s in yaml.safe_load(out.stdout)["services"].items() if "build" in s}

    default = config()
    assert default["server0"] == {"TORCH_VERSION": "2.13.0", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    assert default["gpu-worker0"] == {"TORCH_VERSION": "2.13.0", "TORCH_INDEX_URL": ""}
    mirror = config(TORCH_INDEX_URL="http://mirror.invalid/simple", TORCH_VERSION="2.9.1",
                    GPU_TORCH_INDEX_URL="http://gpu.invalid/simple")
    assert mirror["worker1"] == {"TORCH_VERSION": "2.9.1", "TORCH_INDEX_URL": "http://mirror.invalid/simple"}
    assert mirror["gpu-worker1"] == {"TORCH_VERSION": "2.9.1", "TORCH_INDEX_URL": "http://gpu.invalid/simple"}


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (it comes with Debian's prometheus, which `make test` "
                           "installs with apt as root)")
def test_prometheus_config_is_valid():
    out = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _scrape_targets() -> dict[str, list[str]]:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in prom["scrape_configs"]}


def test_scrape_targets_are_the_compose_services_metrics_ports():
    expected = {f"{n}:{s['environment'][env.METRICS_PORT]}" for n, s in
                {**_shardps_services(), **_workers("gpu")}.items()}
    assert {t for ts in _scrape_targets().values() for t in ts} == expected


def test_compose_servers_are_fenced_through_the_etcd_service():
    """--coordinator: every server names the etcd service, waits for it healthy, and one job holds them all."""
    compose = _compose()
    etcd = compose["services"]["etcd"]
    assert etcd["entrypoint"] == ["etcd"] and "--data-dir" in etcd["command"]
    assert etcd["healthcheck"]["test"] == ["CMD", "shardps", "health", "--etcd", "etcd://127.0.0.1:2379"]
    assert [v.split(":")[0] for v in etcd["volumes"]] == ["etcd"] and "etcd" in compose["volumes"]
    for name, svc in _servers().items():
        assert svc["environment"][env.COORDINATOR] == "etcd://etcd:2379", name
        assert svc["environment"][env.JOB] == "compose", name
        assert svc["depends_on"] == {"etcd": {"condition": "service_healthy"}}, name
    assert "etcd-server" in (DEPLOY / "Dockerfile").read_text()


def test_compose_servers_back_each_other_up():
    """--replicas 2: server i's replica target is server i+1's replica port; each advertises itself."""
    servers = _servers()
    names = sorted(servers)
    for i, name in enumerate(names):
        e, nxt = servers[name]["environment"], servers[names[(i + 1) % len(names)]]["environment"]
        assert e[env.REPLICAS] == "2" and int(e[env.SHARD_INDEX]) == i and int(e[env.NUM_SHARDS]) == len(names)
        assert e[env.REPLICA_TARGET] == f"{names[(i + 1) % len(names)]}:{nxt[env.REPLICA_PORT]}"
        assert e[env.ADVERTISE_ADDRESS] == f"{name}:{e[env.PORT]}"


def test_compose_is_production_grade():
    compose = _compose()
    for name, svc in _servers().items():
        assert svc["healthcheck"]["test"] == ["CMD", "shardps", "health"], name
        assert svc["restart"] == "unless-stopped", name
        mounts = dict(v.split(":", 1) for v in svc["volumes"])
        assert set(mounts) <= set(compose["volumes"]), name  # named volumes, not host paths
        assert any(svc["environment"][env.CHECKPOINT_DIR].startswith(m) for m in mounts.values()), name
    for profile in (None, "gpu"):
        for name, svc in _workers(profile).items():
            assert svc["restart"] == "on-failure", name
            assert svc["healthcheck"] == {"disable": True}, name  # workers serve no gRPC
            assert {s: d["condition"] for s, d in svc["depends_on"].items()} == \
                {s: "service_healthy" for s in _servers()}, name
    for name, svc in _workers("gpu").items():
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
    for svc in _shardps_services().values():  # configured by documented variables only
        assert set(svc["environment"]) <= set(env.ALL)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    user = re.search(r"^USER (\S+)", dockerfile, flags=re.M).group(1)
    assert user not in ("root", "0")
    assert re.search(r'^HEALTHCHECK .*CMD \["shardps", "health"\]', dockerfile, flags=re.M)


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


# -- the compose file, run as local processes ---------------------------------------------------


def _free_port() -> int:
    return chosen_port()  # below the ephemeral range: nothing else takes it before its process binds it


class _Local:
    """The compose services as processes on this machine: each service's ports made free ones,
    ``service:port`` references made ``127.0.0.1:port``, named volumes made folders."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.extra: dict[str, str] = {}  # other services' addresses (etcd's) made local ones
        self.ports = {(n, s["environment"][v]): _free_port() for n, s in _shardps_services().items()
                      for v in PORT_VARS if v in s["environment"]}

    def local(self, value: str) -> str:
        for (svc, port), free in self.ports.items():
            value = value.replace(f"{svc}:{port}", f"127.0.0.1:{free}")
        for address, local in self.extra.items():
            value = value.replace(address, local)
        return value

    def env(self, name: str, svc: dict[str, Any]) -> dict[str, str]:
        out = {}
        for key, value in svc["environment"].items():
            value = str(value)
            if key in PORT_VARS:
                value = str(self.ports[(name, value)])
            elif value == "0.0.0.0":
                value = "127.0.0.1"  # loopback stands for the compose network
            elif key == env.CHECKPOINT_DIR:
                for mount in svc.get("volumes", []):
                    volume, path = mount.split(":", 1)
                    if value.startswith(path):
                        value = str(self.tmp / volume) + value[len(path):]
            out[key] = self.local(value)
        return out

    def start(self, name: str, svc: dict[str, Any], epochs: int | None = None) -> subprocess.Popen:
        """The service's own command; ``epochs``: a worker's ``--epochs`` replaced (shortened)."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SHARDPS_")}
        command = list(svc["command"])
        if epochs is not None:
            command[command.index("--epochs") + 1] = str(epochs)
        return subprocess.Popen([SHARDPS, *command], env={**environ, **self.env(name, svc)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def healthy(self, name: str, svc: dict[str, Any]) -> subprocess.CompletedProcess:
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SHARDPS_")}
        return subprocess.run([SHARDPS if a == "shardps" else a for a in test[1:]], capture_output=True, text=True,
                              env={**environ, **self.env(name, svc)}, timeout=60)


def _metrics(address: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("etcd") is None, reason=ETCD_MISSING)
def test_the_compose_services_come_up_turn_healthy_train_and_serve_their_metrics(tmp_path):
    run = _Local(tmp_path)
    servers, workers = _servers(), _workers()
    procs: list[subprocess.Popen] = []
    etcd = LocalEtcd()
    try:
        etcd.start()  # the etcd service, on a free port; its own healthcheck, pointed there, says so
        run.extra["etcd:2379"] = etcd.endpoints[0]
        check = _compose()["services"]["etcd"]["healthcheck"]["test"][1:]
        check = [SHARDPS if a == "shardps" else a.replace("127.0.0.1:2379", etcd.endpoints[0]) for a in check]
        healthy = subprocess.run(check, capture_output=True, text=True, timeout=60)
        assert healthy.returncode == 0 and healthy.stdout.strip().endswith("SERVING"), healthy.stdout + healthy.stderr
        for name, svc in servers.items():
            procs.append(run.start(name, svc))
        deadline = time.monotonic() + 120  # as Docker retries a healthcheck until it passes
        for name, svc in servers.items():
            while (h := run.healthy(name, svc)).returncode != 0:
                assert time.monotonic() < deadline, f"{name} never turned healthy: {h.stdout}{h.stderr}"
                assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs if p.poll()]
                time.sleep(0.5)  # the healthcheck's retry interval, shortened
            assert h.stdout.strip().endswith("SERVING"), h.stdout
        targets = {job: [run.local(t) for t in ts] for job, ts in _scrape_targets().items()}
        deadline = time.monotonic() + 120
        for address in targets["shardps-servers"]:  # scraped again until it answers, as Prometheus does
            while "shardps_shard_version" not in (_metrics(address) or ""):
                assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs if p.poll()]
                assert time.monotonic() < deadline, f"no server metrics at {address}"
                time.sleep(0.1)  # a scrape that timed out on a busy machine
        # 5 of the compose file's 10 epochs: 2 asp workers x 5 x 22 steps take each shard past version 200,
        # its SHARDPS_CHECKPOINT_EVERY, as the whole run does (checked below), in half the time.
        worker_procs = {name: run.start(name, svc, epochs=5) for name, svc in workers.items()}
        procs += worker_procs.values()
        deadline = time.monotonic() + 120
        for name in worker_procs:  # each worker's target serves its metrics while it trains
            address = run.local(f"{name}:{workers[name]['environment'][env.METRICS_PORT]}")
            assert address in targets["shardps-workers"]
            while "shardps_worker_steps_total" not in (_metrics(address) or ""):
                assert worker_procs[name].poll() is None, worker_procs[name].stderr.read()[-2000:]
                assert time.monotonic() < deadline, f"{name} never served its metrics at {address}"
                time.sleep(0.1)  # another process starting
        for name, p in worker_procs.items():
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"{name}: {err[-3000:]}"
            assert json.loads(out.strip().splitlines()[-1])["steps"] == 5 * 22
        for name, svc in servers.items():  # still healthy, and they checkpoint into the volume
            assert run.healthy(name, svc).returncode == 0
        assert sorted(p.name for p in (tmp_path / "checkpoints" / "checkpoints").iterdir()) == ["shard-0", "shard-1"]
    finally:
        stop_processes(procs)
        etcd.close()
