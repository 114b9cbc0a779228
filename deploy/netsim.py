"""NetCluster: a cluster of hosts on one machine, joined by shaped links (``shardps.netsim``).

Each host is a network namespace with one interface, ``eth0``, the end of a
veth pair whose other end is a port of a Linux bridge in a namespace of its
own::

    host h0 (netns P-h0)   eth0 10.A.B.1 --tbf--+          +--tbf-- port P-h0 --+
    host h1 (netns P-h1)   eth0 10.A.B.2 --tbf--+  veth    +--tbf-- port P-h1 --+-- br0 (netns P-br)
    ...                                                                         |   (partitions: nft drop
                                                                                     rules on its forward hook)

Both directions of every link are shaped by ``tc ... tbf`` at the host's
rate (``link``, or ``links[host]``: a slow straggler). The machine's own
network is never touched: every interface, address and rule lives in the
namespaces the cluster made, the addresses are private (one 10.x.y.0/24
per run), and the names carry the run's prefix (``sps`` and 6 hex digits).

This kernel has tbf, htb and pfifo but no netem: a link has a rate and
nothing else, no added delay, jitter or loss. A cut (``cut``) sets the
bridge's port down; a partition (``partition``) drops frames between groups.

Every process started in a host (``start``, ``run``) gets the host's own
/dev/shm (a directory bind-mounted there in a mount namespace of the
process's own), so processes on one host share shardps's same-host
shared-memory path and processes on different hosts do not: their bytes
cross the links.

Cleanup is complete on ``close()``, on leaving the ``with`` block, at exit
and on SIGTERM (where nothing else handles it); processes started here also
die with this one (``Lifeline``), and the next ``up()`` anywhere on the
machine removes what a cluster whose owner died (SIGKILL) left
(``sweep_stale``: each run records its owner first; deploy/netns.py). Not
thread-safe: one thread drives a cluster.

Over 400 lines: one class that owns a run's namespaces, links, shaping,
faults and processes, whose every call must leave the same record of what
exists for the cleanup; the sweep of dead runs is deploy/netns.py.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from shardps.deploy.lifeline import Lifeline
from shardps.deploy.local import parse_ready, read_ready
from shardps.deploy.netns import (
    COMMAND_TIMEOUT_S,
    SHM_ROOT,
    NetsimError,
    record_path,
    remove_namespaces,
    sh,
    sweep_stale,
    write_record,
)
from shardps.deploy.spawn import child_env, import_time_env, spawner

IFNAME = "eth0"  # every host's interface (GLOO_SOCKET_IFNAME=eth0)
BRIDGE = "br0"
_RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)")
_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_HOST_NAME = re.compile(r"[a-z][a-z0-9]*")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


class NetsimUnavailable(NetsimError):
    """This process cannot make namespaces: one line saying what is missing."""


def parse_rate(text: str) -> int:
    """A link rate (``1gbit``, ``500mbit``, ``200mbit``, ``800kbit``) in bits per second; ValueError if not one."""
    m = _RATE.fullmatch(text.strip().lower())
    bits = int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0
    if bits < 8000:
        raise ValueError(f"link rate {text!r}: expected a number followed by kbit, mbit or gbit, at least 8kbit "
                         "(e.g. 1gbit, 500mbit, 200mbit)")
    return bits


def format_rate(bits: int) -> str:
    """``parse_rate``'s inverse for round figures: 500000000 -> '500mbit'."""
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _UNITS[unit] == 0:
            return f"{bits // _UNITS[unit]}{unit}"
    return f"{bits}bit"


def tbf_args(bits: int) -> list[str]:
    """tc's arguments for one direction of a link at ``bits`` per second.

    burst: 4 ms of the rate, at least 128 KiB (a 64 KiB GSO packet must fit);
    latency 50 ms bounds the queue (rate x 50 ms + burst bytes).
    """
    burst = max(bits // 8 // 250, 128 * 1024)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]


def unavailable() -> str | None:
    """Why this process cannot build a NetCluster (one line), or None if it looks able to.

    Checks the platform, the tools (ip, tc, mount, unshare) and the capabilities
    (CAP_NET_ADMIN, CAP_SYS_ADMIN); ``NetCluster.up`` still reports a
    namespace the kernel refuses.
    """
    if not sys.platform.startswith("linux"):
        return f"shardps.netsim needs Linux network namespaces (this is {sys.platform})"
    for tool in ("ip", "tc", "mount", "unshare"):
        if shutil.which(tool) is None:
            return f"shardps.netsim needs the {tool!r} command on PATH (iproute2 / util-linux)"
    caps = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    except OSError:
        pass
    missing = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        return (f"shardps.netsim needs CAP_NET_ADMIN and CAP_SYS_ADMIN to make network namespaces (run as root); "
                f"this process (uid {os.getuid()}) lacks {' and '.join(missing)}")
    return None


@dataclass(frozen=True)
class Server:
    """A ``shardps server`` process on a host: its gRPC ``address`` (HOST:PORT) once it said it is ready."""

    host: str
    address: str
    proc: subprocess.Popen[str]


_LIVE: list[NetCluster] = []
_handlers_installed = False


def _close_all() -> None:
    for c in list(_LIVE):
        c.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of SIGTERM as the sender meant, now that nothing is left


def _install_handlers() -> None:
    """atexit always; a SIGTERM handler only where nobody else has one (the default: die) and only from the
    main thread. A program with its own handler (``shardps sim``) closes the cluster on its way out."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class NetCluster:
    """Hosts joined by shaped links on this machine (module docstring); ``with NetCluster(4, "500mbit") as c:``.

    ``up()`` builds the network (the ``with`` block does), ``close()`` removes
    it; in between ``start(host, argv)`` / ``run(host, argv, timeout=...)``
    run processes in a host, and ``cut``, ``heal``, ``shape`` and
    ``partition`` change the network under them.

    ``hosts``: a count (hosts h0, h1, ...) or the hosts' names. ``link``: every
    host's rate, both directions; ``links``: rates of some hosts, by name or
    index. ``prefix``: names the run's namespaces (default ``sps`` and 6 random
    hex digits). Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (``unavailable()``).
    """

    def __init__(self, hosts: int | Sequence[str] = 6, link: str = "1gbit",
                 links: Mapping[str | int, str] | None = None, prefix: str | None = None) -> None:
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not names:
            raise ValueError("a NetCluster needs at least one host")
        if len(names) > 250:
            raise ValueError(f"at most 250 hosts (one /24), got {len(names)}")
        bad = [n for n in names if not _HOST_NAME.fullmatch(n)]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct, lower-case letters and digits, got {names}")
        self.prefix = prefix or f"sps{random.getrandbits(24):06x}"
        too_long = [n for n in names if len(self.prefix) + 1 + len(n) > 15]
        if too_long:
            raise ValueError(f"{self.prefix}-{too_long[0]} is longer than an interface name may be (15)")
        self.names = names
        self.rates = {n: parse_rate(link) for n in names}
        for key, rate in (links or {}).items():
            self.rates[self._name(key)] = parse_rate(rate)
        net = random.Random(self.prefix)  # the run's private /24: 10.(64..254).(0..255).0
        self.subnet = f"10.{net.randrange(64, 255)}.{net.randrange(256)}"
        self.ifname = IFNAME
        self._procs: list[subprocess.Popen[Any]] = []
        self._lifeline: Lifeline | None = None
        self._started = False
        self._partitioned = False

    # ---- names and addresses -------------------------------------------------------------------------------
    def _name(self, host: str | int) -> str:
        if isinstance(host, int):
            if not 0 <= host < len(self.names):
                raise ValueError(f"host index {host} is not in [0, {len(self.names)})")
            return self.names[host]
        if host not in self.names:
            raise ValueError(f"no host {host!r}; the hosts are {', '.join(self.names)}")
        return host

    def host(self, host: str | int) -> str:
        """The host's address (10.x.y.z) on the cluster's network."""
        return f"{self.subnet}.{self.names.index(self._name(host)) + 1}"

    def netns(self, host: str | int) -> str:
        """The host's network namespace (``ip netns exec`` it, or ``ip -n`` it)."""
        return f"{self.prefix}-{self._name(host)}"

    @property
    def bridge_netns(self) -> str:
        return f"{self.prefix}-br"

    def _port(self, host: str | int) -> str:
        return f"{self.prefix}-{self._name(host)}"  # the bridge's end of the host's link

    def shm_dir(self, host: str | int) -> str:
        """The directory that is /dev/shm for the host's processes."""
        return str(SHM_ROOT / f"{self.prefix}-{self._name(host)}")

    @property
    def namespaces(self) -> list[str]:
        return [self.netns(n) for n in self.names] + [self.bridge_netns]

    # ---- bring up and tear down ----------------------------------------------------------------------------
    def up(self) -> NetCluster:
        """Sweep what dead runs left, then build the namespaces, links and shaping. Raises NetsimUnavailable
        (one line) without the privileges."""
        if self._started:
            return self
        reason = unavailable()
        if reason is not None:
            raise NetsimUnavailable(reason)
        sweep_stale()
        _install_handlers()
        write_record(self.prefix, self.namespaces, [self.shm_dir(n) for n in self.names])
        self._started = True
        _LIVE.append(self)
        try:
            try:
                sh(["ip", "netns", "add", self.bridge_netns])
            except NetsimError as e:
                raise NetsimUnavailable(f"shardps.netsim cannot make a network namespace: {e}") from None
            br = ["ip", "-n", self.bridge_netns]
            sh([*br, "link", "set", "lo", "up"])
            sh([*br, "link", "add", BRIDGE, "type", "bridge"])
            sh([*br, "link", "set", BRIDGE, "up"])
            for name in self.names:
                self._add_host(name)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, name: str) -> None:
        ns, port = self.netns(name), self._port(name)
        shm = Path(self.shm_dir(name))
        shm.mkdir()
        shm.chmod(0o1777)  # as /dev/shm itself: every user of the host may make segments
        sh(["ip", "netns", "add", ns])
        host, br = ["ip", "-n", ns], ["ip", "-n", self.bridge_netns]
        sh([*host, "link", "set", "lo", "up"])
        sh([*br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns])
        sh([*br, "link", "set", port, "master", BRIDGE])
        sh([*br, "link", "set", port, "up"])
        sh([*host, "addr", "add", f"{self.host(name)}/24", "dev", IFNAME])
        sh([*host, "link", "set", IFNAME, "up"])
        self._shape(name, self.rates[name])

    def _shape(self, name: str, bits: int) -> None:
        for ns, dev in ((self.netns(name), IFNAME), (self.bridge_netns, self._port(name))):
            sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bits)])

    def close(self, grace: float = 5.0) -> None:
        """Stop every process started here (SIGTERM, SIGKILL after ``grace`` s), then remove the namespaces, the
        links and the /dev/shm directories. Idempotent."""
        if not self._started:
            return
        self._started = False
        procs, self._procs = self._procs, []
        pgids = [p.pid for p in procs if p.poll() is None]
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass  # remove_namespaces below kills whatever is still in a host
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
        remove_namespaces(self.namespaces, [self.shm_dir(n) for n in self.names])
        record_path(self.prefix).unlink(missing_ok=True)
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> NetCluster:
        return self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- processes -----------------------------------------------------------------------------------------
    def command(self, host: str | int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` in the host: its network namespace, and its /dev/shm in a mount namespace
        of the process's own."""
        if not argv:
            raise ValueError("an empty command")
        return ["ip", "netns", "exec", self.netns(host), "unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', self.shm_dir(host), *argv]

    def start(self, host: str | int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      stdin: Any = subprocess.DEVNULL, stdout: Any = None, stderr: Any = None,
                      cwd: str | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` in the host (a session of its own, text I/O); stopped by ``close()``. Like Popen."""
        if not self._started:
            raise RuntimeError("the cluster is not up: call up() or use it in a with block")
        if self._lifeline is None:
            self._lifeline = Lifeline()  # shardps processes stop when this one dies, however it dies
        full_env = child_env(os.environ if env is None else env)  # as the fork server's (OpenMP's idle threads)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        proc: Any = self._forked(host, argv, full_env, stdin, stdout, stderr, cwd)
        if proc is None:
            proc = subprocess.Popen(self.command(host, argv), stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                                    text=True, start_new_session=True, **self._lifeline.spawn_kwargs(full_env))
        self._procs.append(proc)
        return proc

    def _forked(self, host: str | int, argv: Sequence[str], env: dict[str, str], stdin: Any, stdout: Any,
                stderr: Any, cwd: str | None) -> Any:
        """``python -m shardps ...`` forked from this process's fork server into the host (deploy/spawn.py,
        ``deploy.netns.enter_host``): ready without importing torch again (about 2 CPU-s a process fresh).
        None where it cannot be (another program, stdin not /dev/null, output not a pipe, a file or inherited, a working
        directory, an environment the fork server was not started with, no fork server): started fresh."""
        if (list(argv[:3]) != [sys.executable, "-m", "shardps"] or stdin != subprocess.DEVNULL or cwd is not None
                or any(o not in (subprocess.PIPE, None) and not hasattr(o, "fileno") for o in (stdout, stderr))):
            return None
        sp = spawner()
        if sp is None or import_time_env(env) != import_time_env(sp.environ):
            return None
        assert self._lifeline is not None
        try:
            return sp.popen(list(argv[3:]), env=env, stdout=stdout, stderr=stderr,
                            lifeline_fd=self._lifeline.read_fd, host=(self.netns(host), self.shm_dir(host)))
        except RuntimeError:  # the fork server is gone: fresh
            return None

    def run(self, host: str | int, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
            input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the host to its end (killed after ``timeout`` s: TimeoutExpired); output captured."""
        proc = self.start(host, argv, env=env, stdin=subprocess.PIPE if input is not None else
                                  subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=COMMAND_TIMEOUT_S)
            raise
        finally:
            if proc in self._procs:
                self._procs.remove(proc)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def start_servers(self, hosts: Sequence[str | int], args: Sequence[str] = (), *, port: int = 0,
                      timeout: float = 60.0, env: Mapping[str, str] | None = None) -> list[Server]:
        """One ``shardps server`` per host, shard i of len(hosts) on hosts[i], bound to the host's address;
        returns once every one said it is ready (within ``timeout`` s). ``args``: more server flags."""
        procs = []
        for i, h in enumerate(hosts):
            argv = [sys.executable, "-m", "shardps", "server", "--host", self.host(h), "--port", str(port),
                    "--shard-index", str(i), "--num-shards", str(len(hosts)), *args]
            procs.append((self._name(h), self.start(h, argv, env=env, stdout=subprocess.PIPE)))
        deadline = time.monotonic() + timeout
        return [Server(h, parse_ready(read_ready(p, max(0.1, deadline - time.monotonic())))[0], p) for h, p in procs]

    def start_worker(self, host: str | int, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                     stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
        """``shardps worker ARGS`` in the host (its JSON result is the last line of its stdout)."""
        return self.start(host, [sys.executable, "-m", "shardps", "worker", *args], env=env, stdout=stdout)

    # ---- what the network does -----------------------------------------------------------------------------
    def traffic(self, host: str | int) -> tuple[int, int]:
        """Bytes the host has sent and received on its link so far: (tx, rx)."""
        out = json.loads(sh(["ip", "-n", self.netns(host), "-j", "-s", "link", "show", IFNAME]))
        stats = out[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def cut(self, host: str | int) -> None:
        """The host's link goes down (its bridge port): nothing in or out until ``heal``."""
        sh(["ip", "-n", self.bridge_netns, "link", "set", self._port(host), "down"])

    def heal(self, host: str | int) -> None:
        """The host's link comes back up."""
        sh(["ip", "-n", self.bridge_netns, "link", "set", self._port(host), "up"])

    def shape(self, host: str | int, rate: str) -> None:
        """Change the host's link rate (both directions) now, e.g. ``shape("h3", "50mbit")``."""
        bits = parse_rate(rate)
        name = self._name(host)
        self._shape(name, bits)
        self.rates[name] = bits

    def partition(self, *groups: Iterable[str | int]) -> None:
        """Drop every frame between hosts of different groups (hosts in no group reach everyone); replaces the
        previous partition. No groups: heal it (``heal_partition``)."""
        sets = [{self._name(h) for h in g} for g in groups]
        if not sets:
            self.heal_partition()
            return
        if len(sets) < 2 or any(not s for s in sets):
            raise ValueError("partition() needs two or more non-empty groups of hosts (none: heal)")
        if sum(len(s) for s in sets) != len(set().union(*sets)):
            raise ValueError(f"a host is in two groups: {[sorted(s) for s in sets]}")
        if shutil.which("nft") is None:
            raise NetsimUnavailable("partition() needs the 'nft' command (nftables) on PATH")
        rules = []
        for i, a in enumerate(sets):
            for j, b in enumerate(sets):
                if i != j:
                    ins = ", ".join(f'"{self._port(h)}"' for h in sorted(a))
                    outs = ", ".join(f'"{self._port(h)}"' for h in sorted(b))
                    rules.append(f"iifname {{ {ins} }} oifname {{ {outs} }} drop")
        body = "\n    ".join(rules)
        # one transaction: the old table (if any) goes and the new one comes at once
        script = ("add table bridge netsim\ndelete table bridge netsim\ntable bridge netsim {\n"
                  "  chain forward {\n    type filter hook forward priority 0; policy accept;\n"
                  f"    {body}\n  }}\n}}\n")
        sh(["ip", "netns", "exec", self.bridge_netns, "nft", "-f", "-"], stdin=script)
        self._partitioned = True

    def heal_partition(self) -> None:
        """Every host reaches every other again."""
        if self._partitioned:
            sh(["ip", "netns", "exec", self.bridge_netns, "nft", "-f", "-"],
                stdin="add table bridge netsim\ndelete table bridge netsim\n")
            self._partitioned = False
