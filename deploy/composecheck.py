"""``make compose-check``: deploy/docker-compose.yml brought up for real on this machine, checked, torn down.

    python -m shardps.deploy.composecheck                     # as root (make compose-check)
    python -m shardps.deploy.composecheck --remove-images     # and remove the images it built afterwards

Docker from Debian's packages (installed when missing; a dockerd started when none answers, stopped after),
the compose project ``shardps-check``, every step with a deadline:

1. the base image: ``python:3.11-slim`` where it can be pulled, else ``shardps-check/base:bookworm`` made
   with debootstrap from this machine's apt mirror (kept as a cache: a second run reuses it);
2. the shardps image built by docker-compose from deploy/Dockerfile on that base, with this machine's CA
   certificates (/usr/local/share/ca-certificates) and the local CPU torch wheel (what ``pip download`` finds
   here) put in deploy/image-extra/ for the build and taken out after; each image that cannot be pulled is
   built from Debian's package where deploy/ has a Dockerfile for it (Prometheus), else its service is
   left out and the summary says why (Grafana);
3. the cluster up: the servers healthy, the workers trained and exited 0 (their exit codes and the JSON
   line each ends its log with), checkpoints in the named volume, Prometheus (through its published port)
   scraping both servers (and whether it scraped the workers while they trained: a worker's run can be shorter
   than one scrape interval);
4. a second run: etcd and the servers stopped and brought up again on the same volumes, then one worker,
   which must say in one line that the job is already complete;
5. failover: server0 stopped, server1 asked to take its shard over (``shardps ctl promote`` on its replica
   port, as a worker that lost server0 would), until etcd names server1 the shard's primary.

Everything it made goes on every way out (SIGINT, SIGTERM and SIGHUP included): ``docker-compose down -v``,
the files put in deploy/image-extra/, the dockerd it started, and what that dockerd changed in the network
(deploy/dockerhost.py); then it checks that the network, Docker's processes and mounts are as before. The
images stay (``--remove-images``: the two it built; the base image only with ``--remove-base-image``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from shardps.deploy import dockerhost as dh
from shardps.deploy.local import wait_gone

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
EXTRA = DEPLOY / "image-extra"  # the build's optional CA certificates and wheels (deploy/Dockerfile)
PROJECT = "shardps-check"
IMAGE = "shardps-check/shardps:latest"
LOCAL_BUILDS = {"prometheus": DEPLOY / "prometheus"}  # where its image cannot be pulled: Debian's package
OFFICIAL_BASE = "python:3.11-slim"
BASE_TAG = "shardps-check/base:bookworm"
BASE_SUITE = "bookworm"  # Python 3.11, as the official base and the cp311 torch wheel
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
HOST_CAS = Path("/usr/local/share/ca-certificates")
LOCK = Path("/run/shardps-compose-check.lock")
RUN_DIRS = (Path("/run/docker"), Path("/run/containerd"))  # a dockerd's and its shims' state: gone after it
PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "iptables": "iptables"}

DOCKERD_S = 60.0
PULL_S = 120.0
DEBOOTSTRAP_S = 900.0
BUILD_S = 1800.0
UP_S = 300.0
HEALTHY_S = 180.0
TRAIN_S = 900.0
PROMETHEUS_S = 90.0
SECOND_RUN_S = 300.0
TAKEOVER_S = 90.0
DOWN_S = 180.0


class CheckFailed(Exception):
    """A check did not pass; the message is its measured figure or what went wrong."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP: stop the checks and tear down."""


# -- pure parts ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Service:
    """One service of the compose file, as ``docker-compose config`` renders it."""

    name: str
    image: str
    built: bool  # has a build section (the shardps image)
    profiles: tuple[str, ...]
    command: tuple[str, ...]
    environment: Mapping[str, str]
    host_ports: tuple[int, ...]

    @property
    def role(self) -> str:
        """server, worker, or the service's name (etcd, prometheus, grafana)."""
        return self.command[0] if self.command[:1] in (("server",), ("worker",)) else self.name


def services(config: Mapping[str, Any]) -> dict[str, Service]:
    """The services of a parsed ``docker-compose config``."""
    out = {}
    for name, s in config["services"].items():
        ports = []
        for p in s.get("ports", ()):
            published = p.get("published") if isinstance(p, dict) else str(p).split(":")[0]
            if published:
                ports.append(int(published))
        env = s.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        command = s.get("command") or ()
        out[name] = Service(name, s.get("image", ""), "build" in s, tuple(s.get("profiles") or ()),
                            tuple(command.split() if isinstance(command, str) else command),
                            {k: str(v) for k, v in env.items()}, tuple(ports))
    return out


def docker_time(stamp: str) -> float:
    """A Docker timestamp (RFC 3339 with nanoseconds, ``2026-12-05T22:35:42.124009337Z``) in seconds."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp.strip())
    if m is None:
        raise ValueError(f"not a Docker timestamp: {stamp!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(f"0.{m.group(2) or 0}")


def healthy_after(state: Mapping[str, Any]) -> float | None:
    """Seconds from a container's start to the end of its first passing healthcheck (``docker inspect``'s
    State); None before one passed."""
    started = docker_time(state["StartedAt"])
    passed = [docker_time(h["End"]) for h in (state.get("Health") or {}).get("Log") or ()
              if h.get("ExitCode") == 0 and docker_time(h["Start"]) >= started]
    return min(passed) - started if passed else None


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` if it is a JSON object (a worker's summary), else None."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        d = json.loads(lines[-1])
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def summary(rows: Sequence[tuple[str, str, str]]) -> str:
    """The final table: one line a check, its result and what was measured."""
    out = ["| check | result | measured |", "|---|---|---|"]
    return "\n".join(out + [f"| {name} | {result} | {figure} |" for name, result, figure in rows])


# -- the run -------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """One compose-check: its steps, rows and everything it must take down."""

    remove_images: bool = False
    remove_base: bool = False
    base_image: str | None = None
    t0: float = field(default_factory=time.monotonic)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="shardps-compose-check-")))
    dockerd: dh.Dockerd | None = None
    net_before: dh.NetState | None = None
    procs_before: dict[int, str] = field(default_factory=dict)
    run_dirs_before: tuple[Path, ...] = RUN_DIRS
    staged: list[Path] = field(default_factory=list)
    override: Path | None = None
    svc: dict[str, Service] = field(default_factory=dict)
    up: list[str] = field(default_factory=list)
    local: list[str] = field(default_factory=list)  # services whose image is built here from Debian's package
    built: list[str] = field(default_factory=list)
    base: str = ""
    build_env: dict[str, str] = field(default_factory=dict)

    def say(self, msg: str) -> None:
        print(f"compose-check [{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    # -- docker-compose and docker ---------------------------------------------------------------------------

    def compose_cmd(self, *args: str) -> list[str]:
        files = ["-f", str(COMPOSE)] + (["-f", str(self.override)] if self.override and self.override.exists()
                                        else [])
        return ["docker-compose", "-p", PROJECT, *files, *args]

    def compose(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        return dh.run(self.compose_cmd(*args), timeout, check=check, env={**os.environ, **self.build_env})

    def inspect(self, service: str) -> dict[str, Any]:
        ids = self.compose("ps", "-q", service, timeout=60).stdout.split()
        if not ids:
            raise CheckFailed(f"{service}: no container")
        return dict(json.loads(dh.run(["docker", "inspect", ids[0]], 60).stdout)[0])

    def logs(self, service: str) -> tuple[str, str]:
        ids = self.compose("ps", "-q", service, timeout=60).stdout.split()
        proc = dh.run(["docker", "logs", ids[0]], 60, check=False) if ids else None
        return (proc.stdout, proc.stderr) if proc else ("", "")

    # -- the steps -------------------------------------------------------------------------------------------

    def setup(self) -> str:
        installed = dh.install_packages(PACKAGES)
        self.svc = services(_yaml(self.compose("config", timeout=60).stdout))
        self.run_dirs_before = tuple(d for d in RUN_DIRS if d.exists())
        self.procs_before = dh.docker_processes()
        figure = f"installed {', '.join(installed)}; " if installed else ""
        if dh.docker_answers():
            figure += "a dockerd already answered (left running)"
        else:
            self.net_before = dh.net_state()
            self.dockerd = dh.Dockerd(self.work / "dockerd.log")
            self.say("starting dockerd")
            figure += f"dockerd started, ready in {self.dockerd.start(DOCKERD_S):.1f} s"
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=DOWN_S)  # an earlier run's
        return figure

    def base_step(self) -> str:
        if self.base_image:
            self.base = self.base_image
            return f"{self.base} (--base-image)"
        why = dh.pull(OFFICIAL_BASE, PULL_S)
        if why is None:
            self.base = OFFICIAL_BASE
            return f"{OFFICIAL_BASE} pulled"
        self.say(f"{OFFICIAL_BASE} cannot be pulled: {why}")
        self.base = BASE_TAG
        if dh.image_exists(BASE_TAG):
            return f"{OFFICIAL_BASE} cannot be pulled; {BASE_TAG} (debootstrap) from the cache"
        dh.install_packages({"debootstrap": "debootstrap"})
        mirror = dh.host_apt_mirror(BASE_SUITE)
        self.say(f"debootstrap {BASE_SUITE} from {mirror} into {BASE_TAG}")
        t = time.monotonic()
        dh.debootstrap_image(BASE_TAG, BASE_SUITE, mirror, BASE_PACKAGES, DEBOOTSTRAP_S, self.work)
        return f"{OFFICIAL_BASE} cannot be pulled; {BASE_TAG} made by debootstrap in {time.monotonic() - t:.0f} s"

    def images_step(self) -> str:
        """Which services come up: every one of the default profile, those with an image that cannot be pulled
        only where deploy/ builds it (then from the override)."""
        override: dict[str, dict[str, Any]] = {}
        notes = []
        for s in self.svc.values():
            if s.profiles:
                continue
            if s.built:
                override[s.name] = {"image": IMAGE}
            else:
                why = dh.pull(s.image, PULL_S)
                if why is not None and s.name in LOCAL_BUILDS:
                    tag = f"shardps-check/{s.name}:debian"
                    override[s.name] = {"image": tag, "build": {"context": str(LOCAL_BUILDS[s.name])}}
                    self.local.append(s.name)
                    notes.append(f"{s.name}: {s.image} cannot be pulled, built from Debian's package as {tag}")
                elif why is not None:
                    self.rows.append((s.name, "SKIP", f"{s.image} cannot be pulled ({why}); Debian has no "
                                                      f"package of it: left out"))
                    self.say(f"{s.name} left out: {s.image} cannot be pulled ({why})")
                    continue
            self.up.append(s.name)
        busy = [p for n in self.up for p in self.svc[n].host_ports if not _port_free(p)]
        if busy:
            raise CheckFailed(f"ports {busy} are in use on this machine: the compose file publishes them")
        self.override = self.work / "override.json"
        self.override.write_text(json.dumps({"services": override}, indent=1))
        return "; ".join(notes) or "every image pulled or built"

    def build_step(self) -> str:
        wheel = self.stage_extras()
        if wheel is not None:
            version = re.match(r"torch-([^-]+)-", wheel.name)
            self.build_env = {"TORCH_VERSION": version.group(1) if version else "", "TORCH_INDEX_URL": ""}
        # one service of the shardps image builds it for all; then the images made from Debian's packages
        to_build = [n for n in self.up if self.svc[n].built][:1] + self.local
        self.say(f"building {', '.join(to_build)} on {self.base} (log {self.work / 'build.log'})")
        t = time.monotonic()
        with open(self.work / "build.log", "w") as log:
            try:
                proc = subprocess.run(self.compose_cmd("build", "--build-arg", f"BASE_IMAGE={self.base}", *to_build),
                                      stdout=log, stderr=subprocess.STDOUT, timeout=BUILD_S, text=True,
                                      env={**os.environ, **self.build_env})
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"the build took more than {BUILD_S:.0f} s") from None
        self.unstage()
        if proc.returncode != 0:
            tail = (self.work / "build.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise CheckFailed(f"docker-compose build: exit code {proc.returncode}: {' | '.join(tail)}")
        self.built = [IMAGE, *(f"shardps-check/{n}:debian" for n in self.local)]
        extras = f"; torch {self.build_env['TORCH_VERSION']} from {wheel.name}" if wheel else ""
        return f"{', '.join(self.built)} in {time.monotonic() - t:.0f} s{extras}"

    def stage_extras(self) -> Path | None:
        """This machine's CA certificates and the CPU torch wheel into deploy/image-extra/ (never over a file
        already there); the wheel, or None when pip finds none (the build then takes torch from its index)."""
        for crt in sorted(HOST_CAS.glob("*.crt")):
            self._stage(crt)
        version = os.environ.get("TORCH_VERSION", "2.13.0")
        dest = self.work / "wheels"
        proc = dh.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest",
                       str(dest), "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                       "--platform", "manylinux_2_28_x86_64", f"torch=={version}+cpu"], 600, check=False)
        wheels = sorted(dest.glob("torch-*.whl"))
        if proc.returncode != 0 or not wheels:
            self.say(f"no local CPU torch {version} wheel (pip download: exit code {proc.returncode}): the build "
                     f"takes torch from TORCH_INDEX_URL")
            return None
        staged = self._stage(wheels[0])
        self.say(f"staged {len(self.staged)} file(s) in {EXTRA.relative_to(ROOT)}: "
                 f"{', '.join(p.name for p in self.staged)}")
        return staged

    def _stage(self, src: Path) -> Path:
        dst = EXTRA / src.name
        if not dst.exists():
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            self.staged.append(dst)
        return dst

    def unstage(self) -> None:
        for p in self.staged:
            p.unlink(missing_ok=True)
        self.staged.clear()

    def up_step(self) -> str:
        self.say(f"docker-compose up -d {' '.join(self.up)}")
        self.compose("up", "-d", "--no-build", *self.up, timeout=UP_S)
        return self.wait_healthy()

    def wait_healthy(self) -> str:
        servers = [n for n in self.up if self.svc[n].role == "server"]
        deadline = time.monotonic() + HEALTHY_S
        while True:
            states = {n: self.inspect(n)["State"] for n in servers}
            waiting = [n for n, s in states.items() if (s.get("Health") or {}).get("Status") != "healthy"]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise CheckFailed(f"not healthy within {HEALTHY_S:.0f} s: {', '.join(waiting)}")
            time.sleep(1.0)  # the poll interval of docker inspect
        after = {n: healthy_after(s) for n, s in states.items()}
        return ", ".join(f"{n} healthy {a:.1f} s after its start" if a is not None else f"{n} healthy"
                         for n, a in after.items())

    def workers_step(self) -> str:
        workers = [n for n in self.up if self.svc[n].role == "worker"]
        deadline = time.monotonic() + TRAIN_S
        while True:
            states = {n: self.inspect(n) for n in workers}
            restarted = [n for n, c in states.items() if c["RestartCount"]]
            if restarted:
                raise CheckFailed(f"{', '.join(restarted)} failed and restarted: {self._tail(restarted[0])}")
            if all(c["State"]["Status"] == "exited" for c in states.values()):
                break
            if time.monotonic() > deadline:
                raise CheckFailed(f"still training after {TRAIN_S:.0f} s")
            time.sleep(2.0)  # the poll interval of docker inspect
        figures, bad = [], []
        for n, c in states.items():
            code = c["State"]["ExitCode"]
            out = last_json(self.logs(n)[0])
            loss = out.get("final_loss") if out else None
            if code != 0 or out is None or not isinstance(loss, (int, float)) or not math.isfinite(loss):
                bad.append(f"{n}: exit code {code}, last line {self._tail(n)!r}")
                continue
            figures.append(f"{n} exit 0, {out['steps']} steps in {out['seconds']:.1f} s, final loss {loss:.3f}")
        if bad:
            raise CheckFailed("; ".join(bad))
        return "; ".join(figures)

    def _tail(self, service: str) -> str:
        out, err = self.logs(service)
        lines = [line for line in (out + err).splitlines() if line.strip()]
        return lines[-1][:200] if lines else "(no output)"

    def checkpoints_step(self) -> str:
        server = next(self.svc[n] for n in self.up if self.svc[n].role == "server")
        where = server.environment.get("SHARDPS_CHECKPOINT_DIR", "/var/lib/shardps/checkpoints")
        mount = str(Path(where).parent)
        volumes = dh.run(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                         60).stdout.split()
        [volume] = [v for v in volumes if v.endswith("_checkpoints")] or [""]
        if not volume:
            raise CheckFailed(f"no checkpoints volume among {volumes}")
        found = dh.run(["docker", "run", "--rm", "-v", f"{volume}:{mount}", "--entrypoint", "find", IMAGE, where,
                        "-name", "step-*.json"], 120).stdout.split()
        shards: dict[str, list[int]] = {}
        for path in found:
            m = re.search(r"shard-(\d+)/step-(\d+)\.json$", path)
            if m:
                shards.setdefault(m.group(1), []).append(int(m.group(2)))
        expected = {s.environment.get("SHARDPS_SHARD_INDEX", "?") for s in self.svc.values() if s.role == "server"}
        if set(shards) != expected:
            raise CheckFailed(f"checkpoints of shards {sorted(shards)} in {volume}, expected {sorted(expected)}")
        return f"{volume}: " + ", ".join(f"shard {k}: {len(v)} (newest version {max(v)})"
                                         for k, v in sorted(shards.items()))

    def prometheus_step(self) -> str:
        if "prometheus" not in self.up:
            raise CheckFailed("prometheus is not up")
        port = self.svc["prometheus"].host_ports[0]
        base = f"http://127.0.0.1:{port}/api/v1"
        servers = {n for n in self.up if self.svc[n].role == "server"}
        workers = {n for n in self.up if self.svc[n].role == "worker"}
        deadline = time.monotonic() + PROMETHEUS_S
        while True:
            try:
                targets = _get(f"{base}/targets")["activeTargets"]
                health = {t["labels"]["instance"].split(":")[0]: t["health"] for t in targets}
                down = [n for n in servers if health.get(n) != "up"]
            except (OSError, ValueError, KeyError) as e:
                down, health = [f"({e})"], {}
            if not down:
                break
            if time.monotonic() > deadline:
                raise CheckFailed(f"servers not up in Prometheus within {PROMETHEUS_S:.0f} s: {down}")
            time.sleep(1.0)  # the poll interval of the targets API
        query = urllib.parse.quote('max_over_time(up{job="shardps-workers"}[1h])')
        scraped = {r["metric"]["instance"].split(":")[0] for r in _get(f"{base}/query?query={query}")["result"]
                   if float(r["value"][1]) == 1.0}
        # a worker serves metrics only while it trains, which can be shorter than one scrape interval: said, not
        # required
        unused = sorted(set(health) - servers - workers)
        return (f"{len(servers)}/{len(servers)} servers up (port {port}); workers scraped while they trained: "
                f"{', '.join(sorted(workers & scraped)) or 'none'} of {len(workers)}"
                + (f"; targets of services not started: {', '.join(unused)}" if unused else ""))

    def second_run_step(self) -> str:
        stack = [n for n in self.up if self.svc[n].role in ("etcd", "server")]
        worker = next(n for n in self.up if self.svc[n].role == "worker")
        self.say(f"stopping {' '.join(stack)} and bringing them up again on the same volumes")
        self.compose("stop", *stack, timeout=DOWN_S)
        self.compose("up", "-d", "--no-build", *stack, timeout=UP_S)
        healthy = self.wait_healthy()
        t = time.monotonic()
        proc = self.compose("run", "--rm", "-T", "--no-deps", worker, timeout=SECOND_RUN_S, check=False)
        seconds = time.monotonic() - t
        said = [line for line in proc.stderr.splitlines() if "already complete" in line]
        out = last_json(proc.stdout)
        if proc.returncode != 0 or len(said) != 1 or not out or not out.get("already_complete") \
                or out.get("final_loss") is not None:
            raise CheckFailed(f"{worker}: exit code {proc.returncode}, {len(said)} 'already complete' line(s), "
                              f"last line {(proc.stdout.strip().splitlines() or ['(none)'])[-1][:200]!r}")
        self.say(f"{worker} said: {said[0]}")
        step = re.search(r"already complete: it is at step \d+", said[0])
        return f"{healthy}; {worker} exit 0 in {seconds:.1f} s: '{step.group(0) if step else said[0]}'"

    def failover_step(self) -> str:
        servers = [self.svc[n] for n in self.up if self.svc[n].role == "server"]
        victim = servers[0]
        target = victim.environment["SHARDPS_REPLICA_TARGET"]  # HOST:PORT of the backup of its shard
        backup = target.rsplit(":", 1)[0]
        shard = victim.environment["SHARDPS_SHARD_INDEX"]
        coordinator, job = victim.environment["SHARDPS_COORDINATOR"], victim.environment["SHARDPS_JOB"]

        def record() -> dict[str, Any]:
            proc = self.compose("exec", "-T", backup, "python", "-m", "shardps.deploy.composecheck", "shard-record",
                                coordinator, job, shard, timeout=60)
            return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

        before = record()
        self.say(f"shard {shard} before: {before}; stopping {victim.name}")
        self.compose("stop", victim.name, timeout=DOWN_S)
        t = time.monotonic()
        deadline, now, attempts = t + TAKEOVER_S, before, 0
        while True:
            attempts += 1
            proc = self.compose("exec", "-T", backup, "shardps", "ctl", "--addresses", target, "--timeout", "10",
                                "promote", timeout=60, check=False)
            answer = ((proc.stdout.strip() or proc.stderr.strip()).splitlines() or [""])[-1]
            if proc.returncode == 0:
                now = record()
                if now["primary"] != before["primary"] and now["epoch"] > before["epoch"]:
                    break
            if time.monotonic() > deadline:
                raise CheckFailed(f"no takeover within {TAKEOVER_S:.0f} s: etcd says {now}; last answer "
                                  f"{answer!r}")
            time.sleep(1.0)  # the retry interval of a refused takeover
        seconds = time.monotonic() - t
        if now["primary"] != target:  # the name the workers reach it by (SHARDPS_ADVERTISE_ADDRESS's host)
            raise CheckFailed(f"etcd names the new primary of shard {shard} {now['primary']!r}, not {target!r}")
        return (f"{backup} took shard {shard} over {seconds:.1f} s after {victim.name} stopped: etcd names "
                f"{now['primary']} (epoch {before['epoch']} -> {now['epoch']}); promote answered at attempt "
                f"{attempts}: {answer}")

    # -- teardown --------------------------------------------------------------------------------------------

    def teardown(self) -> str:
        done: list[str] = []
        problems: list[str] = []

        def attempt(what: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
            try:
                result = fn(*args, **kwargs)
                done.append(f"{what}: {result}" if isinstance(result, str) else what)
            except (dh.DockerHostError, OSError) as e:
                problems.append(f"{what}: {e}")

        self.unstage()
        if self.dockerd is not None or dh.docker_answers():
            attempt("compose down -v", self.compose, "down", "-v", "--remove-orphans", "--timeout", "10",
                    timeout=DOWN_S)
            images = (self.built if self.remove_images else []) + ([BASE_TAG] if self.remove_base else [])
            for image in images:
                attempt(f"removed {image}", dh.run, ["docker", "rmi", image], 120)
        if self.dockerd is not None:
            attempt("dockerd", self.dockerd.stop)
            stray = {p: n for p, n in dh.docker_processes().items() if p not in self.procs_before}
            left = wait_gone(list(stray), 30.0)  # containerd and its shims end after the daemon
            if left:
                attempt(f"killed {', '.join(f'{stray[p]} ({p})' for p in left)} left after dockerd",
                        dh.kill_processes, left)
            assert self.net_before is not None
            plan = dh.undo_plan(self.net_before, dh.net_state())
            for cmd in plan:
                try:
                    dh.run(cmd, 30)
                except dh.DockerHostError as e:
                    problems.append(str(e))
            done.append(f"{len(plan)} network change(s) undone")
            for d in RUN_DIRS:
                if d not in self.run_dirs_before:
                    shutil.rmtree(d, ignore_errors=True)
            problems += [f"not as before: {d}" for d in dh.differences(self.net_before, dh.net_state())]
            problems += [f"still running: {n} (pid {p})" for p, n in dh.docker_processes().items()
                         if p not in self.procs_before]
            problems += [f"still mounted: {m}" for m in dh.docker_mounts()]
            problems += [f"still there: {d}" for d in RUN_DIRS if d.exists() and d not in self.run_dirs_before]
        for line in problems:
            self.say(f"teardown: {line}")
        kept = [i for i in [BASE_TAG if self.base == BASE_TAG and not self.remove_base else "",
                            *([] if self.remove_images else self.built)] if i]
        figure = "; ".join(done)
        if kept:
            figure += f"; images kept: {', '.join(kept)}"
        if problems:
            raise CheckFailed(figure + "; " + "; ".join(problems))
        if self.dockerd is not None:
            figure += "; links, iptables, nft tables, ip_forward, Docker's processes, mounts and /run as before"
        return figure

    # -- driving it ------------------------------------------------------------------------------------------

    def step(self, name: str, fn: Callable[[], str]) -> bool:
        """Run one step: its row (PASS with its figure, or FAIL with why), and whether it passed."""
        t = time.monotonic()
        self.say(f"{name} ...")
        try:
            figure = fn()
        except (CheckFailed, dh.DockerHostError) as e:
            why = str(e)
        except Exception as e:  # anything else fails the step too: the teardown and the summary still come
            why = f"{type(e).__name__}: {e}"
        else:
            self.rows.append((name, "PASS", figure))
            self.say(f"{name}: PASS ({time.monotonic() - t:.1f} s): {figure}")
            return True
        self.rows.append((name, "FAIL", why))
        self.say(f"{name}: FAIL ({time.monotonic() - t:.1f} s): {why}")
        return False

    def run(self) -> int:
        self.say(f"load {_load()}; work directory {self.work}")
        steps: list[tuple[str, Callable[[], str], bool]] = [  # name, step, whether the rest needs it
            ("docker", self.setup, True),
            ("base image", self.base_step, True),
            ("images", self.images_step, True),
            ("build", self.build_step, True),
            ("servers healthy", self.up_step, True),
            ("workers trained", self.workers_step, True),
            ("checkpoints in the volume", self.checkpoints_step, False),
            ("prometheus scrapes", self.prometheus_step, False),
            ("second run: already complete", self.second_run_step, False),
            ("failover: takeover", self.failover_step, False),
        ]
        interrupted = ""
        try:
            for i, (name, fn, needed) in enumerate(steps):
                if not self.step(name, fn) and needed:
                    self.rows += [(n, "NOT RUN", f"{name} failed") for n, _, _ in steps[i + 1:]]
                    break
        except Interrupted as e:
            interrupted = str(e)
            self.rows.append(("interrupted", "FAIL", f"by {interrupted}"))
        finally:
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            self.step("teardown", self.teardown)
        self.say(f"load {_load()}")
        print(summary(self.rows), flush=True)
        failed = [r for r in self.rows if r[1] in ("FAIL", "NOT RUN")]
        if failed:
            print(f"compose-check: FAILED ({len(failed)} of {len(self.rows)}); logs kept in {self.work}", flush=True)
            return 130 if interrupted else 1
        shutil.rmtree(self.work, ignore_errors=True)
        print(f"compose-check: PASSED in {time.monotonic() - self.t0:.0f} s", flush=True)
        return 0


def _yaml(text: str) -> dict[str, Any]:
    import yaml  # type: ignore[import-untyped]  # PyYAML: the dev extras' (Ray, transformers)

    return dict(yaml.safe_load(text))


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise ValueError(f"{url}: {body}")
    return dict(body["data"])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with open(LOCK, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"compose-check: another one runs ({LOCK} is locked)") from None
        try:
            yield
        finally:
            LOCK.unlink(missing_ok=True)


def shard_record(coordinator: str, job: str, shard: int) -> dict[str, Any] | None:
    """What etcd says of a shard (run inside the cluster, where etcd is reachable): primary, epoch, alone, and
    whether a lease holds it."""
    from shardps.server.checks import parse_coordinator
    from shardps.server.coordinator import Etcd, ShardLease

    etcd = Etcd(parse_coordinator(coordinator))
    try:
        r = ShardLease(etcd, job, shard, "compose-check:0").read()
    finally:
        etcd.close()
    return None if r is None else {"primary": r.primary, "epoch": r.epoch, "alone": r.alone, "held": r.holder != 0}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["shard-record"]:  # the probe the failover step runs in the backup's container
        rp = argparse.ArgumentParser(prog="python -m shardps.deploy.composecheck shard-record")
        rp.add_argument("coordinator")
        rp.add_argument("job")
        rp.add_argument("shard", type=int)
        a = rp.parse_args(argv[1:])
        print(json.dumps(shard_record(a.coordinator, a.job, a.shard)))
        return 0
    ap = argparse.ArgumentParser(prog="python -m shardps.deploy.composecheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--remove-images", action="store_true", help="remove the images it built when done")
    ap.add_argument("--remove-base-image", action="store_true",
                    help=f"remove the base image it made with debootstrap too ({BASE_TAG}; kept by default)")
    ap.add_argument("--base-image", help=f"build on this image (default: {OFFICIAL_BASE} if it can be pulled, "
                                         f"else {BASE_TAG})")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("compose-check: needs root (Docker, apt, iptables)", file=sys.stderr)
        return 2
    if not COMPOSE.exists():
        print(f"compose-check: {COMPOSE} not found (run it from a checkout)", file=sys.stderr)
        return 2

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupt)
    with _lock():
        return Run(remove_images=a.remove_images, remove_base=a.remove_base_image, base_image=a.base_image).run()


if __name__ == "__main__":
    sys.exit(main())
