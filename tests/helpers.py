"""Test helpers: worker functions in threads (their first error re-raised), ``shardps`` processes (and
killing what a failed test left), two workers training over a data
path (gRPC, shared memory, TCP), a real Prometheus."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

import shardps
from shardps.deploy.spawn import Process, spawn


def chosen_port() -> int:
    """A free port for a test to hand a process it starts later (or stops and starts again at the same
    address), below the kernel's range for ephemeral ports: no other process's bind to port 0 and no
    client's connect (a gRPC channel, a data connection) can take it in between. Seen under load with ports
    from that range: a restarted server, and a worker's metrics port, could not bind theirs."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def run_workers(fn: Callable[[int], Any], n: int, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(worker_id)`` for ids 0..n-1 in parallel threads; return their results."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def target(k: int) -> None:
        try:
            results[k] = fn(k)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=target, args=(k,), name=f"worker{k}") for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{t.name} did not finish within {timeout}s")
    if errors:
        raise errors[0]
    return results


def shardps_process(*args: str, stderr: int | None = None) -> Process:
    """``python -m shardps ARGS``, stdout a pipe, forked from this process's fork server as LocalCluster's
    servers are (deploy/spawn.py; tests/test_processes.py starts the command fresh)."""
    return spawn(list(args), env=dict(os.environ), stderr=stderr)


def kill_left(proc: subprocess.Popen[Any], leftovers: Callable[[], Iterable[int]]) -> None:
    """What a failed test left behind must not outlive it: ``proc`` killed if it still runs and reaped, then
    SIGKILL to each pid of ``leftovers()`` still there (asked once ``proc`` has ended)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    for pid in leftovers():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def path_model() -> nn.Module:
    """The small model the data-path tests train (seeded: every call gives the same weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 3))


def train_over_paths(addresses: list[str], *, shm: bool, steps: int = 3,
                     **opt_kw: Any) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    """Two workers in threads train ``path_model()`` (Adam, parts of 1 KiB) for ``steps`` steps on their own
    seeded batches. Each returns (the kind of its data path to each shard, by class: "ShmConnPath" with
    ``shm``, else "ConnPath"; its final parameters)."""
    base = path_model()

    def worker(k: int) -> tuple[list[str], dict[str, torch.Tensor]]:
        model = copy.deepcopy(base)
        client = shardps.connect(addresses, worker_id=k, num_workers=2, part_bytes=1024, shm=shm)
        try:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), **opt_kw)
            kinds = [type(p).__name__ for p in client.paths]
            for step in range(steps):
                g = torch.Generator().manual_seed(10 * k + step)
                x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            return kinds, {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            client.close()

    return run_workers(worker, 2)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> dict[str, Any]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def wait_for(self, expr: str, timeout: float = 60.0) -> list[Any]:
        """Poll until ``expr`` returns samples (Prometheus scrapes on its own schedule)."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(expr)
            if res["status"] == "success" and res["data"]["result"]:
                return res["data"]["result"]  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no samples for {expr!r} within {timeout}s: {res}")
            time.sleep(0.25)  # polling a remote process's state: nothing to wait on locally


def start_prometheus(binary: str, tmp: Path, timeout: float = 60.0) -> tuple[subprocess.Popen[str], Prometheus]:
    """Debian's prometheus on a free port with ``tmp/prometheus.yml``; returns once it is ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, prom
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("prometheus did not become ready")
        time.sleep(0.2)  # polling a starting process


def stop_prometheus(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if proc.stderr is not None:
        proc.stderr.close()


# The tests of --coordinator need a real etcd: Debian's etcd-server, which `make tools` (and so `make test`) installs
# where it can (root and apt-get). Elsewhere they skip, saying so; the rest of the suite does not need it.
ETCD_MISSING = ("etcd is not installed: these tests need a real etcd server (Debian's etcd-server), which "
                "`make tools`, run by `make test`, installs as root")


def on_return(handler: Any, done: Callable[[Any], None], refused: Callable[[], None] | None = None) -> Any:
    """A gRPC method ``handler`` (what a server interceptor's continuation gives) that calls ``done(request)``
    (a streamed request: its iterator) once its behavior has returned, its last response sent included; a
    test that waits for it reads the server's state after the handler's work, not at the call's arrival.
    ``refused()``: called instead where a unary request does not parse (its behavior then never runs)."""
    kind = f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"
    inner = getattr(handler, kind)

    def returning(request, context):  # type: ignore[no-untyped-def]
        try:
            return inner(request, context)
        finally:
            done(request)

    def yielding(request, context):  # type: ignore[no-untyped-def]
        try:
            yield from inner(request, context)
        finally:
            done(request)

    parse = handler.request_deserializer
    if refused is not None and not handler.request_streaming and parse is not None:
        def parsed(data):  # type: ignore[no-untyped-def]
            try:
                return parse(data)
            except Exception:
                refused()
                raise
    else:
        parsed = parse
    return getattr(grpc, f"{kind}_rpc_method_handler")(yielding if handler.response_streaming else returning,
                                                        request_deserializer=parsed,
                                                        response_serializer=handler.response_serializer)
