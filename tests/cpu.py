"""Where the suite's CPU goes, test by test: a pytest plugin.

    .venv/bin/python -m pytest -p tests.cpu -p no:xdist [--cpu-out FILE] [tests ...]

For each test it reads the whole machine's busy CPU time (/proc/stat: user, nice, system, irq, softirq)
before and after, so what the test's own processes, servers, workers and Ray actors spent is counted,
not only the pytest process's. That is only the test's when nothing else runs beside it: run it in one
process (``-p no:xdist``) on a quiet machine; with ``-n`` it refuses. At the end it prints the tests and
modules that took the most CPU seconds, and with ``--cpu-out`` writes one JSON line per test (``id``,
``cpu_s``, ``wall_s``). docs/history/performance-log.md, "The test suite's time", has a run of it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest

from benchmarks.proccpu import machine_cpu

TOP = 25


def busy_seconds() -> float:
    """The machine's busy CPU seconds since boot, all cores: what its processes and the kernel's work for them
    spent (not idle, iowait, or steal: a virtual machine's cores waiting for the host)."""
    c = machine_cpu()
    return c["user"] + c["nice"] + c["system"] + c["irq"] + c["softirq"]


class CpuPerTest:
    def __init__(self, out: str | None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.out = open(out, "w") if out else None  # noqa: SIM115 (closed at the session's end)
        self.start = busy_seconds()
        self.t0 = time.monotonic()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        b0, t0 = busy_seconds(), time.monotonic()
        yield
        row = {"id": item.nodeid, "cpu_s": round(busy_seconds() - b0, 2), "wall_s": round(time.monotonic() - t0, 2)}
        self.rows.append(row)
        if self.out is not None:
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        total, wall = busy_seconds() - self.start, time.monotonic() - self.t0
        in_tests = sum(r["cpu_s"] for r in self.rows)
        tr.section("CPU seconds (the whole machine's, per test)")
        tr.write_line(f"{total:.0f} CPU-s in {wall:.0f} s ({total / wall:.2f} cores busy on average), "
                      f"{in_tests:.0f} of them during the tests ({len(self.rows)})")
        modules: Counter[str] = Counter()
        for r in self.rows:
            modules[r["id"].split("::", 1)[0]] += r["cpu_s"]
        tr.write_line("modules:")
        for name, cpu in modules.most_common(TOP):
            tr.write_line(f"  {cpu:8.1f}  {name}")
        tr.write_line("tests:")
        for r in sorted(self.rows, key=lambda r: -r["cpu_s"])[:TOP]:
            tr.write_line(f"  {r['cpu_s']:8.1f}  {r['wall_s']:7.1f} s  {r['id']}")
        if self.out is not None:
            self.out.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-out", default=None, help="tests.cpu: write one JSON line per test to this file")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("-p tests.cpu counts the whole machine's CPU per test: run it in one process "
                                "(-p no:xdist or -n 0), not beside other tests")
    config.pluginmanager.register(CpuPerTest(config.getoption("--cpu-out")), "shardps-cpu-per-test")
