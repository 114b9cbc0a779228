"""Network namespaces made by a run, and their removal: the lower half of ``NetCluster`` (deploy/netsim.py).

Every run records its owner before it makes its first namespace
(``RECORDS/<prefix>.json``: pid and start time, namespaces, /dev/shm
directories). ``remove_namespaces`` kills whatever runs in them and deletes
them (a veth goes with its namespace); ``sweep_stale`` does that for every
run whose owner is dead (SIGKILL, OOM) and for namespaces of the default
prefix family that no record claims. ``sh`` runs one command with a deadline.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from shardps.deploy.local import wait_gone

RECORDS = Path("/run/shardps-netsim")  # <prefix>.json per run: its owner, namespaces and /dev/shm directories
SHM_ROOT = Path("/dev/shm")  # a host's /dev/shm is the directory SHM_ROOT/<prefix>-<host>
FAMILY = re.compile(r"sps[0-9a-f]{6}")  # default prefixes: what the sweep removes even without a record
COMMAND_TIMEOUT_S = 15.0  # one ip / tc / nft command


class NetsimError(RuntimeError):
    """A command that builds or changes the simulated network failed (the message names it)."""


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18


def enter_host(netns: str, shm_dir: str) -> None:
    """Make this process one of a simulated host's: what ``NetCluster.command`` runs a program under (``ip netns
    exec NETNS unshare --mount --propagation private`` and ``mount --bind SHM_DIR /dev/shm``), done in the
    process itself: for a child forked from the fork server (deploy/spawn.py), which has one thread. Root only;
    OSError naming the step that failed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns into network namespace {netns}")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private (mount --make-rprivate)")
    check(libc.mount(shm_dir.encode(), str(SHM_ROOT).encode(), None, _MS_BIND, None),
          f"mount --bind {shm_dir} {SHM_ROOT}")


def sh(cmd: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    """Run one command with a deadline; its stdout. NetsimError (the command and its first error line) on failure."""
    try:
        proc = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetsimError(f"{' '.join(cmd)}: no answer within {COMMAND_TIMEOUT_S:.0f}s") from None
    if check and proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[0]
        raise NetsimError(f"{' '.join(cmd)}: {first}")
    return proc.stdout


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid from a reused one), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def netns_list() -> list[str]:
    """The machine's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in sh(["ip", "netns", "list"], check=False).splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.split()]


def _kill_and_wait(pids: Iterable[int], sig: int, timeout: float) -> list[int]:
    """Send ``sig`` to every pid, wait (pidfd) until each has exited; the pids alive at the deadline."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        sent.append(pid)
    return wait_gone(sent, timeout)


def remove_namespaces(namespaces: Iterable[str], shm_dirs: Iterable[str] = ()) -> None:
    """Kill every process in the namespaces, delete them (their links go with them) and the /dev/shm dirs."""
    present = set(netns_list())
    namespaces = [ns for ns in namespaces if ns in present]
    pids = {p for ns in namespaces for p in _netns_pids(ns)} - {os.getpid()}
    left = _kill_and_wait(pids, signal.SIGKILL, 10.0)
    if left:
        raise NetsimError(f"processes {left} in {namespaces} survived SIGKILL for 10s")
    for ns in namespaces:
        sh(["ip", "netns", "delete", ns])
    for d in shm_dirs:
        shutil.rmtree(d, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove what clusters whose owner has died left behind: their processes, namespaces, links and /dev/shm
    directories, and namespaces of the default prefix family that no record claims. Returns the prefixes removed.

    One sweep at a time on the machine (a lock in RECORDS). The namespaces are listed before the records are
    read: a run writes its record before it makes its first namespace, so a run being built meanwhile is seen
    with its record, never as an orphan."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    with open(RECORDS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held for a sweep's few commands, each with a deadline
        existing = netns_list()
        removed = []
        claimed: set[str] = set()
        for path in sorted(RECORDS.glob("*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if start_time(rec["pid"]) == rec["start_time"]:  # its owner lives
                claimed.update(rec["namespaces"])
                continue
            remove_namespaces(rec["namespaces"], rec["shm_dirs"])
            path.unlink(missing_ok=True)
            claimed.update(rec["namespaces"])
            removed.append(rec["prefix"])
        orphans: dict[str, list[str]] = {}
        for ns in existing:
            m = re.match(rf"({FAMILY.pattern})-", ns)
            if m and ns not in claimed:
                orphans.setdefault(m.group(1), []).append(ns)
        for prefix, namespaces in orphans.items():
            remove_namespaces(namespaces, [str(p) for p in SHM_ROOT.glob(f"{prefix}-*")])
            removed.append(prefix)
    return removed


def write_record(prefix: str, namespaces: Sequence[str], shm_dirs: Sequence[str]) -> None:
    """Say that this process owns ``namespaces`` (before making the first of them)."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    tmp = RECORDS / f".{prefix}.tmp"  # written whole, then renamed: a sweep never reads half a record
    tmp.write_text(json.dumps({
        "prefix": prefix, "pid": os.getpid(), "start_time": start_time(os.getpid()),
        "namespaces": list(namespaces), "shm_dirs": list(shm_dirs)}))
    os.replace(tmp, record_path(prefix))


def record_path(prefix: str) -> Path:
    return RECORDS / f"{prefix}.json"
