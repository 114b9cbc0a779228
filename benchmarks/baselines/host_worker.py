#!/usr/bin/env python
"""One worker of benchmarks/cluster.py, run as a process inside a simulated host: DDP, shardps or the raw PS.

    python benchmarks/baselines/host_worker.py ddp --rank R --world N --master HOST:PORT --ifname DEV ...
    python benchmarks/baselines/host_worker.py shardps --rank R --world N --addresses A,B,... ...
    python benchmarks/baselines/host_worker.py raw-ps --rank R --world N --addresses A,B,... ...   (baselines/raw_ps.py)

Trains ``baselines/common.py``'s MLP with SGD (lr 0.01) for ``--warmup`` +
``--steps`` steps. Prints ``{"phase": "timed"}`` when the timed steps begin
(the driver samples the servers' CPU then), and at the end one JSON line:
``times``, the timed steps' seconds (forward + backward + sync + step);
``cpu_s``, this process's CPU seconds over them; with ``--timeline``, the
bytes sent and received on the host's link (``/sys/class/net/IFNAME``)
every 5 ms during the last timed step: ``timeline`` [[s, tx, rx], ...]. A step starts when every
worker is ready to: the workers meet at a barrier before the first timed
step (gloo's for DDP, a shardps bsp step for shardps), so start-up skew is
not timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from baselines.common import batch, loss_fn, mlp  # noqa: E402


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("-"))


class Timeline:
    """The host link's byte counters every 5 ms, in a thread, between ``start`` and ``stop``."""

    def __init__(self, ifname: str) -> None:
        base = Path("/sys/class/net") / ifname / "statistics"
        self.tx, self.rx = base / "tx_bytes", base / "rx_bytes"
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        t0 = time.perf_counter()

        def loop() -> None:
            while not self._stop.wait(0.005):
                self.samples.append([time.perf_counter() - t0, int(self.tx.read_text()), int(self.rx.read_text())])

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class Steps:
    """The timed part of the loop: step times, each step's forward and backward, this process's CPU, the
    link's timeline (last step)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.times: list[float] = []
        self.compute: list[float] = []  # each timed step's forward + backward, seconds
        self.cpu0 = 0.0
        self.timeline = Timeline(a.ifname) if a.timeline else None

    def begin(self, step: int) -> float:
        if step == self.a.warmup:
            print(json.dumps({"phase": "timed"}), flush=True)
            self.cpu0 = time.process_time()
        if self.timeline is not None and step == self.a.warmup + self.a.steps - 1:
            self.timeline.start()
        return time.perf_counter()

    def end(self, step: int, t0: float, compute: float) -> None:
        if step >= self.a.warmup:
            self.times.append(time.perf_counter() - t0)
            self.compute.append(compute)

    def result(self) -> dict[str, object]:
        out: dict[str, object] = {"times": self.times, "compute": self.compute,
                                  "cpu_s": time.process_time() - self.cpu0}
        if self.timeline is not None:
            self.timeline.stop()
            out["timeline"] = self.timeline.samples
        return out


def train(a: argparse.Namespace, model: torch.nn.Module, opt: Any,
          at_warmup: Callable[[], object] | None = None) -> dict[str, object]:
    """``a.warmup`` steps, then ``a.steps`` timed ones (``Steps``); ``at_warmup`` runs before the first timed."""
    steps = Steps(a)
    for step in range(a.warmup + a.steps):
        x, y = batch(step, a.rank, a.batch, a.dims)
        if step == a.warmup and at_warmup is not None:
            at_warmup()
        t0 = steps.begin(step)
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        steps.end(step, t0, t1 - t0)
    return steps.result()


def run_ddp(a: argparse.Namespace) -> dict[str, object]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    try:
        model = DistributedDataParallel(mlp(a.dims))
        return train(a, model, torch.optim.SGD(model.parameters(), lr=0.01), at_warmup=dist.barrier)
    finally:
        dist.destroy_process_group()


def run_shardps(a: argparse.Namespace) -> dict[str, object]:
    import shardps
    import shardps.compress

    model = mlp(a.dims)
    half = torch.bfloat16 if a.wire == "bf16" else None
    with shardps.connect(a.addresses.split(","), worker_id=a.rank, num_workers=a.world,
                         timeout=a.timeout, part_bytes=a.part_bytes) as client:
        compress = None if a.compress == "none" else shardps.compress.parse(a.compress)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.01), sync=a.sync,
                                           grad_dtype=half, pull_dtype=half, push_window=a.window,
                                           compress=compress)
        return train(a, model, opt)


def run_raw_ps(a: argparse.Namespace) -> dict[str, object]:
    from baselines.raw_ps import Client

    model = mlp(a.dims)
    client = Client(model, a.addresses.split(","), a.rank, a.timeout, parts=a.parts, window=a.window,
                    native=a.native)
    try:
        return train(a, model, client)
    finally:
        client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("system", choices=("ddp", "shardps", "raw-ps"))
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dims", type=_dims, default=(1024, 2048, 1024, 10))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--master", help="ddp: HOST:PORT of rank 0's store")
    p.add_argument("--ifname", default="eth0", help="the host's network device (GLOO_SOCKET_IFNAME)")
    p.add_argument("--timeline", action="store_true", help="sample the link's counters in the last timed step")
    p.add_argument("--addresses", help="shardps: the shards, in shard order; raw-ps: its servers, in order")
    p.add_argument("--sync", default="bsp")
    p.add_argument("--wire", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--window", type=int, default=None,
                   help="shardps: push_window; raw-ps --parts: parts unanswered at once (default: every one)")
    p.add_argument("--compress", default="none", help="shardps: none, topk:RATIO or powersgd:RANK")
    p.add_argument("--parts", type=int, default=1, help="raw-ps: parts a server, each a message (raw_ps.py --parts)")
    p.add_argument("--native", action="store_true",
                   help="raw-ps: each step's parts in C (raw_ps.py --native, baselines/raw_ps_native.c)")
    p.add_argument("--part-bytes", type=int, default=None,
                   help="shardps: connect(part_bytes=): the size the model is cut into (default: the library's)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    result = {"ddp": run_ddp, "shardps": run_shardps, "raw-ps": run_raw_ps}[a.system](a)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
