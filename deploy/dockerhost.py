"""Docker on this machine for one run (``make compose-check``, deploy/composecheck.py): Debian's packages when
missing, a dockerd started when none answers and stopped after, what it changed in the network put back, and a
base image made with debootstrap where none can be pulled.

What a dockerd changes in the host's network (Debian 12, Docker 20.10): a ``docker0`` bridge (a compose
network's ``br-<id>`` bridge goes with ``docker-compose down``), ``DOCKER*`` chains in iptables' filter and nat
tables with jumps to them from the built-in chains, FORWARD's policy set to DROP, the nft tables iptables-nft
made for them, and ``net.ipv4.ip_forward=1``. ``NetState`` is a snapshot of those; ``undo_plan(before, after)``
the commands that take ``after`` back to ``before``, touching only what Docker made, and ``differences`` what
still differs (both pure: tests/test_dockerhost.py).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shardps.deploy.local import wait_gone

TABLES = ("filter", "nat")  # the iptables tables Docker writes
DOCKER_LINK = re.compile(r"docker0|br-[0-9a-f]{12}|veth[0-9a-f]{7}")  # bridges and container veths Docker makes
DOCKER_PROCESSES = ("dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "docker-proxy", "runc")
DOCKER_MOUNTS = ("/var/lib/docker", "/run/docker", "/var/run/docker")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")  # exit 101: a package installed now starts no service
APT_TIMEOUT_S = 900.0


class DockerHostError(RuntimeError):
    """A step that sets Docker up on this machine failed (the message names the command and its error)."""


def run(cmd: Sequence[str], timeout: float, *, check: bool = True, stdin: IO[bytes] | None = None,
        env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One command with a deadline; DockerHostError (the command, its first error line) if it fails or is late."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, stdin=stdin,
                              env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        raise DockerHostError(f"{shlex.join(cmd)}: no answer within {timeout:.0f} s") from None
    except FileNotFoundError:
        raise DockerHostError(f"{cmd[0]}: not installed") from None
    if check and proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines() or [f"exit code {proc.returncode}"]
        raise DockerHostError(f"{shlex.join(cmd)}: {lines[-1]}")
    return proc


# -- Debian's packages ----------------------------------------------------------------------------------------

def install_packages(packages: Mapping[str, str]) -> list[str]:
    """Install with apt the packages ({command: package}) whose command is missing; the packages installed.

    A ``/usr/sbin/policy-rc.d`` that exits 101 is in place while apt runs (there is no init here to start a
    daemon, and the run starts what it needs itself); one that was there already stays, one written here goes.
    """
    missing = sorted({pkg for command, pkg in packages.items() if shutil.which(command) is None})
    if not missing:
        return []
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DockerHostError(f"{', '.join(missing)} missing: installing them needs root and apt-get")
    wrote = not POLICY_RC_D.exists()
    if wrote:
        POLICY_RC_D.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-qq"], APT_TIMEOUT_S, env=env)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], APT_TIMEOUT_S, env=env)
    finally:
        if wrote:
            POLICY_RC_D.unlink(missing_ok=True)
    return missing


def apt_mirror(sources: Mapping[str, str], suite: str) -> str | None:
    """The first ``deb`` URI that apt's sources (``{file name: text}``, one-line ``.list`` or deb822
    ``.sources``) name for ``suite``; None if none does."""
    for name, text in sources.items():
        if name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if (fields.get("enabled", "yes").lower() != "no" and "deb" in fields.get("types", "").split()
                        and suite in fields.get("suites", "").split() and fields.get("uris")):
                    return fields["uris"].split()[0]
        elif name.endswith(".list"):
            for line in text.splitlines():
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1]
    return None


def host_apt_mirror(suite: str) -> str:
    """The mirror this machine's apt uses for ``suite`` (/etc/apt/sources.list and sources.list.d)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    sources = {str(p): p.read_text() for p in files if p.is_file() and p.suffix in (".list", ".sources")}
    mirror = apt_mirror(sources, suite)
    if mirror is None:
        raise DockerHostError(f"no apt source for {suite} in {', '.join(sources) or '/etc/apt'}: no mirror for "
                              f"debootstrap")
    return mirror


# -- the daemon -----------------------------------------------------------------------------------------------

def docker_answers(timeout: float = 10.0) -> bool:
    """Whether a Docker daemon answers ``docker info`` now."""
    try:
        return run(["docker", "info"], timeout, check=False).returncode == 0
    except DockerHostError:
        return False


class Dockerd:
    """A ``dockerd`` this run started (in a session of its own, its log in ``log_path``), and its stop."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> float:
        """Start it and wait until ``docker info`` answers; the seconds that took. DockerHostError on time out
        (with the end of its log)."""
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        while not docker_answers(timeout=5.0):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise DockerHostError(f"dockerd (pid {self.proc.pid}) not ready within {timeout:.0f} s"
                                      f"{'' if self.proc.poll() is None else f', exit code {self.proc.returncode}'}"
                                      f": {self.log_tail()}")
            time.sleep(0.2)  # the poll interval of docker info
        return time.monotonic() - t0

    def log_tail(self, lines: int = 3) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> str:
        """SIGTERM, then SIGKILL at the deadline; how it ended."""
        if self.proc is None or self.proc.poll() is not None:
            return "not running"
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            return f"stopped (exit code {self.proc.returncode})"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10.0)
            return f"killed after {timeout:.0f} s"


def docker_processes() -> dict[int, str]:
    """The Docker daemons, shims and proxies running now: {pid: name}."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                name = (d / "comm").read_text().strip()
            except OSError:
                continue
            if name in DOCKER_PROCESSES:
                out[int(d.name)] = name
    return out


def kill_processes(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL these pids and wait until they are gone; those still alive."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            sent.append(pid)
        except OSError:
            continue
    return wait_gone(sent, timeout)


def docker_mounts() -> list[str]:
    """Mount points under Docker's directories (each should go with its daemon and containers)."""
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if len(line.split()) > 1]
    return [p for p in points if p.startswith(DOCKER_MOUNTS)]


# -- the network it changes -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class NetState:
    """What Docker changes in the host's network: link names, ``iptables -t T -S`` lines per table, nft tables
    (``nft list tables`` lines) and ``net.ipv4.ip_forward``."""

    links: frozenset[str]
    rules: Mapping[str, tuple[str, ...]]
    nft_tables: frozenset[str]
    ip_forward: str


def net_state() -> NetState:
    links = frozenset(line.split(": ")[1].split("@")[0] for line in run(["ip", "-o", "link"], 15).stdout.splitlines()
                      if ": " in line)
    rules = {t: tuple(run(["iptables", "-t", t, "-S"], 15).stdout.splitlines()) for t in TABLES}
    nft = run(["nft", "list", "tables"], 15, check=False).stdout if shutil.which("nft") else ""
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    return NetState(links, rules, frozenset(line.strip() for line in nft.splitlines() if line.strip()), forward)


def _dockers(rule: str) -> bool:
    """Whether an ``iptables -S`` line is Docker's: it names a DOCKER* chain or one of Docker's bridges."""
    return any(w.startswith("DOCKER") or DOCKER_LINK.fullmatch(w) for w in shlex.split(rule))


def undo_plan(before: NetState, after: NetState) -> list[list[str]]:
    """The commands that remove what Docker added between ``before`` and ``after``: its jumps, its chains
    (flushed, then deleted), the policies it changed, its links, the nft tables only it used, ip_forward."""
    plan: list[list[str]] = []
    emptied = []
    for t in TABLES:
        old, new = set(before.rules.get(t, ())), after.rules.get(t, ())
        added = [r for r in new if r not in old]
        jumps = [r for r in added if r.startswith("-A ") and _dockers(r) and not r.split()[1].startswith("DOCKER")]
        chains = [r.split()[1] for r in added if r.startswith("-N ") and r.split()[1].startswith("DOCKER")]
        plan += [["iptables", "-t", t, "-D", *shlex.split(r)[1:]] for r in jumps]
        plan += [["iptables", "-t", t, "-F", c] for c in chains]
        plan += [["iptables", "-t", t, "-X", c] for c in chains]
        policies = {r.split()[1]: r.split()[2] for r in before.rules.get(t, ()) if r.startswith("-P ")}
        plan += [["iptables", "-t", t, "-P", r.split()[1], policies[r.split()[1]]] for r in added
                 if r.startswith("-P ") and r.split()[1] in policies]
        left = [r for r in new if not r.startswith("-P ") and r not in jumps and r.split()[1] not in chains]
        if not left:
            emptied.append(t)
    for t in emptied:  # iptables-nft made the table for Docker's rules; nothing else is in it
        line = f"table ip {t}"
        if line in after.nft_tables and line not in before.nft_tables:
            plan.append(["nft", "delete", "table", "ip", t])
    plan += [["ip", "link", "delete", name] for name in sorted(after.links - before.links)
             if DOCKER_LINK.fullmatch(name)]
    if after.ip_forward != before.ip_forward:
        plan.append(["sysctl", "-q", "-w", f"net.ipv4.ip_forward={before.ip_forward}"])
    return plan


def differences(before: NetState, after: NetState) -> list[str]:
    """What differs between the two snapshots, one line each (empty: the same)."""
    out = [f"link {n} {'appeared' if n in after.links else 'went'}" for n in sorted(before.links ^ after.links)]
    for t in TABLES:
        old, new = set(before.rules.get(t, ())), set(after.rules.get(t, ()))
        out += [f"iptables -t {t}: {r!r} {'appeared' if r in new else 'went'}" for r in sorted(old ^ new)]
    out += [f"nft {n!r} {'appeared' if n in after.nft_tables else 'went'}"
            for n in sorted(before.nft_tables ^ after.nft_tables)]
    if before.ip_forward != after.ip_forward:
        out.append(f"net.ipv4.ip_forward {before.ip_forward} -> {after.ip_forward}")
    return out


# -- a base image from Debian's packages ----------------------------------------------------------------------

def image_exists(tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], 30, check=False).returncode == 0


def pull(image: str, timeout: float) -> str | None:
    """Pull ``image``; None when it came, else why not (docker's last line)."""
    try:
        proc = run(["docker", "pull", "-q", image], timeout, check=False)
    except DockerHostError as e:
        return str(e)
    if proc.returncode == 0:
        return None
    return ((proc.stderr.strip() or proc.stdout.strip()).splitlines() or [f"exit code {proc.returncode}"])[-1]


def _unmount_under(root: Path) -> list[str]:
    """Unmount (lazily) whatever is mounted under ``root``, deepest first; those that stay mounted."""
    def under() -> list[str]:
        points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        return sorted((p for p in points if p == str(root) or p.startswith(f"{root}/")), key=len, reverse=True)

    for point in under():
        run(["umount", "-l", point], 30, check=False)
    return under()


def debootstrap_image(tag: str, suite: str, mirror: str, include: Sequence[str], timeout: float,
                      workdir: Path) -> None:
    """``debootstrap --variant=minbase`` of ``suite`` into a directory under ``workdir``, imported as ``tag``.

    Made like Debian's own images: a policy-rc.d that exits 101 (packages installed in a build start no
    service), no apt caches, PATH and LANG set. The directory goes afterwards, never while anything is still
    mounted under it.
    """
    root = Path(tempfile.mkdtemp(prefix="shardps-debootstrap-", dir=workdir))
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(include)}", suite, str(root), mirror],
            timeout)
        (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
        (root / "usr/sbin/policy-rc.d").chmod(0o755)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (root / cache).glob("*"):
                if f.is_file():
                    f.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            run(["docker", "import", "--change", f"ENV PATH={path}", "--change", "ENV LANG=C.UTF-8",
                 "--change", 'CMD ["bash"]', "-", tag], timeout, stdin=tar.stdout)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(60)
        if tar.returncode != 0:
            raise DockerHostError(f"tar of {root} for docker import: exit code {tar.returncode}")
    finally:
        stuck = _unmount_under(root)
        if stuck:
            raise DockerHostError(f"{root} left in place: still mounted under it: {', '.join(stuck)}")
        shutil.rmtree(root, ignore_errors=True)
