"""What the benchmark scripts run under: SIGTERM ends them cleanly, a watchdog bounds them.

SIGTERM and the watchdog raise KeyboardInterrupt in the main thread, which
unwinds through the script's ``with LocalCluster(...)`` / ``finally`` blocks
and so stops the servers it started. If that unwinding hangs for 30 s, the
watchdog kills the child processes itself and exits with status 3.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def run_guarded(name: str, max_seconds: float, run: Callable[[], T],
                children: Callable[[], Iterable[subprocess.Popen[str]]]) -> T | None:
    """``run()``, or None (after saying why on stderr) if it was interrupted or ran over ``max_seconds``."""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(max_seconds):
            return
        print(f"{name}: over --max-seconds {max_seconds:.0f}s, aborting", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        if not done.wait(30):  # the unwinding hung: kill the children (own sessions) ourselves
            for proc in children():
                if proc.poll() is None:
                    proc.kill()
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        return run()
    except KeyboardInterrupt as e:
        print(f"{name}: interrupted ({e})", file=sys.stderr)
        return None
    finally:
        done.set()


def cluster_processes(clusters: Iterable[object]) -> list[subprocess.Popen[str]]:
    """The server processes of LocalClusters started with processes=True."""
    return [p for c in clusters for p in getattr(c, "_procs", [])]
