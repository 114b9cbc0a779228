"""Run the fault tests many times in a row while other processes load the cores.

``make stress`` (or ``python -m tests.stress --repeat 20 --load 2``): the
tests marked ``fault`` (kills, restarts, failovers, leases) inject their
faults at exact points, so their outcome must not depend on how fast the
machine is. This runs them ``--repeat`` times, each time as a fresh pytest
process, beside ``--load`` processes that spin on a core each, and prints
how often each test failed. Exit status 1 if any did.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def _spin() -> None:
    while True:
        pass


def _results(junit: Path) -> dict[str, bool]:
    """test id -> passed, from a junit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failed = any(child.tag in ("failure", "error") for child in case)
        skipped = any(child.tag == "skipped" for child in case)
        if not skipped:
            out[name] = not failed
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20, help="runs of the whole fault suite (default 20)")
    p.add_argument("--load", type=int, default=2, help="busy processes beside the tests (default 2)")
    p.add_argument("-m", dest="marker", default="fault", help="pytest marker expression (default: fault)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression, to narrow the set")
    p.add_argument("--max-minutes", type=float, default=600.0, help="stop starting new runs after this long")
    p.add_argument("--keep", default=None, metavar="DIR", help="write the output of every failed run here")
    args = p.parse_args(argv)

    load = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for proc in load:
        proc.start()
    runs: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeat):
                if time.monotonic() - t0 > args.max_minutes * 60:
                    print(f"stopping after {i} runs: --max-minutes {args.max_minutes:g} reached", flush=True)
                    break
                junit = Path(tmp) / f"run{i}.xml"
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", args.marker,
                       f"--junitxml={junit}"]
                if args.keyword:
                    cmd += ["-k", args.keyword]
                start = time.monotonic()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if not junit.exists():
                    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                    return 1
                results = _results(junit)
                for name, ok in results.items():
                    runs[name] += 1
                    failures[name] += 0 if ok else 1
                bad = [n for n, ok in results.items() if not ok]
                print(f"run {i + 1}/{args.repeat}: {len(results)} tests, {len(bad)} failed, "
                      f"{time.monotonic() - start:.0f}s" + (f": {bad}" if bad else ""), flush=True)
                if bad:
                    print(proc.stdout[-4000:], flush=True)
                    if args.keep:
                        Path(args.keep).mkdir(parents=True, exist_ok=True)
                        (Path(args.keep) / f"run{i + 1}.txt").write_text(proc.stdout + proc.stderr)
    finally:
        for proc in load:
            proc.terminate()
    print(f"\n{'test':<100} runs  failed")
    for name in sorted(runs):
        print(f"{name:<100} {runs[name]:>4}  {failures[name]:>6}")
    total = sum(failures.values())
    print(f"\n{sum(runs.values())} test runs with {args.load} busy processes, {total} failures, "
          f"{(time.monotonic() - t0) / 60:.1f} min")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
