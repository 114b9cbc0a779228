"""What a call costs right after a sleep, against the same call warm: why a pipeline stage's hand-over is
kept to a few cheap calls (docs/pipeline.md, "The hand-over").

    .venv/bin/python benchmarks/cold_calls.py [--sleep-ms 0 1 10] [--repeats 200] [--spin] [--json]

For each sleep: the median wall time of a few calls made right after
``time.sleep`` (each timed on its own, in this order): ``struct.pack`` of a
header, ``torch.empty`` of a small tensor, ``SocketLink.send`` of a 1x4
tensor to a neighbour (a real link pair over a Unix socket, in this
process; the neighbour takes each value before the next sleep); then, in a
loop of its own, a stage's task: ``StageRuntime.forward`` then ``backward``
of one micro-batch of a stage whose module only multiplies by a parameter.
A sleep of 0 is the warm baseline: the ratios are against it, in this run.

``--spin``: wait by spinning on the core (a loop reading the clock) instead
of sleeping. A call as slow after a spin as after a sleep is not slowed by
the core having idled (its power state, a wake-up), but by the time that
passed: on a virtual machine, other guests' work on the same physical core
evicts this process's code and data from its caches meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from shardps.worker.pipeline.linkconnect import open_socket_link  # noqa: E402
from shardps.worker.pipeline.schedule import Kind  # noqa: E402
from shardps.worker.pipeline.stage import StageRuntime  # noqa: E402

HEADER = struct.Struct("<16q")


class Scale(torch.nn.Module):
    """A stage's module that does next to nothing: one multiply by a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def spin(seconds: float) -> None:
    """Busy-wait ``seconds`` on this core."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(sleep_ms: list[float], repeats: int, wait: Callable[[float], None] = time.sleep) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    pair: list = [None, None]

    def make(r: int) -> None:
        pair[r] = open_socket_link(store, "pp/cold", r, 2, "127.0.0.1", 30)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a, b = pair
    a.start(0, 600)
    b.start(0, 600)
    value, rows, mb = torch.ones(1, 4), [], 0
    rt = StageRuntime(Scale(), index=1, num_stages=3, checkpoint="never")
    rt.begin_step(0, 1)
    for ms in sleep_ms:
        times: dict[str, list[float]] = {"struct.pack": [], "torch.empty": [], "SocketLink.send": [],
                                         "stage task": []}
        for _ in range(repeats):
            if ms:
                wait(ms / 1e3)
            t0 = time.perf_counter()
            HEADER.pack(*range(16))
            t1 = time.perf_counter()
            torch.empty(1, 4)
            t2 = time.perf_counter()
            a.send(Kind.FORWARD, 0, mb, value)
            t3 = time.perf_counter()
            b.recv(Kind.FORWARD, 0, mb)
            mb += 1
            for name, x, z in (("struct.pack", t0, t1), ("torch.empty", t1, t2), ("SocketLink.send", t2, t3)):
                times[name].append((z - x) * 1e6)
        for _ in range(repeats):  # on its own: a task's calls evict the others' from the caches
            if ms:
                wait(ms / 1e3)
            t0 = time.perf_counter()
            y = rt.forward(mb, value)
            rt.backward(mb, torch.ones_like(y))
            times["stage task"].append((time.perf_counter() - t0) * 1e6)
            mb += 1
        rows.append({"sleep_ms": ms, **{k: round(statistics.median(v), 1) for k, v in times.items()}})
    a.close()
    b.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep-ms", type=float, nargs="+", default=[0, 1, 10])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--spin", action="store_true", help="wait by spinning on the core instead of sleeping")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if 0 not in args.sleep_ms:
        args.sleep_ms = [0.0, *args.sleep_ms]
    rows = measure(args.sleep_ms, args.repeats, spin if args.spin else time.sleep)
    if args.json:
        print(json.dumps(rows))
        return
    base = next(r for r in rows if r["sleep_ms"] == 0)
    names = [k for k in rows[0] if k != "sleep_ms"]
    how = "a spin" if args.spin else "a sleep"
    print(f"median us per call, right after {how} ({args.repeats} each; ratio to the warm call)")
    print(f"{'spin ms' if args.spin else 'sleep ms':>9} " + " ".join(f"{n:>24}" for n in names))
    for r in rows:
        print(f"{r['sleep_ms']:>9g} " + " ".join(f"{r[n]:>14.1f} ({r[n] / base[n]:>5.1f}x)" for n in names))


if __name__ == "__main__":
    main()
