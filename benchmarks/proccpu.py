"""CPU seconds of processes, read from /proc: the figure the benchmarks print beside wall time (the machine's
other work moves it far less)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (field 3 on), or None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def process_cpu(pid: int) -> float:
    """A process's CPU seconds (user + system) so far, 0 once it is gone."""
    fields = stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) so far of this process and of ``pids``."""
    return sum(os.times()[:2]) + sum(process_cpu(pid) for pid in pids)


def threads_cpu(pid: int) -> float:
    """A process's CPU seconds so far to the nanosecond: the sum of its live threads' time on a CPU
    (/proc/PID/task/*/schedstat), 0 once it is gone. /proc/PID/stat counts in clock ticks (10 ms here),
    too coarse for a round of tens of milliseconds; a thread that ended takes its time with it, so only
    for processes whose threads outlive the measurement."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # ended in between
    return total / 1e9


def precise_cpu(pids: Iterable[int]) -> float:
    """``cpu_seconds`` to the nanosecond: this process's CPU clock (every thread, ended ones too) and
    ``threads_cpu`` of ``pids``."""
    return time.process_time() + sum(threads_cpu(pid) for pid in pids)


def session_cpu(sessions: set[int]) -> float:
    """CPU seconds (user + system) of every live process in the sessions ``sessions`` (by session id)."""
    total = 0.0
    for d in os.listdir("/proc"):
        fields = stat(int(d)) if d.isdigit() else None
        if fields is not None and int(fields[3]) in sessions:  # field 6 of stat: the session id
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> dict[str, float]:
    """The whole machine's CPU seconds so far, all cores summed, by kind (/proc/stat's ``cpu`` line): what
    every process and the kernel's own work on their behalf (``softirq``: packets through the bridges, veths
    and tbf queues of a simulated network) spent, ``idle``, and ``steal`` (time a virtual machine's cores
    waited for the host)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:1 + len(STAT_FIELDS)]
    return {k: int(v) / os.sysconf("SC_CLK_TCK") for k, v in zip(STAT_FIELDS, fields)}


def machine_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two ``machine_cpu()``: each kind's share of all the cores' time, and ``busy`` (all but idle
    and iowait)."""
    d = {k: after[k] - before[k] for k in STAT_FIELDS}
    total = sum(d.values()) or 1.0
    out = {k: v / total for k, v in d.items()}
    out["busy"] = 1.0 - out["idle"] - out["iowait"]
    return out
