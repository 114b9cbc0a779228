#!/usr/bin/env python
"""A parameter server's CPU floor: raw sockets, one message a worker and server a step, no framing.

    python benchmarks/baselines/raw_ps.py --host H --world N --lo A --hi B --steps S   # one server (prints READY)

benchmarks/cluster.py's ``raw-ps`` row: the same placement as shardps's (k
server hosts, one process each, each owning a contiguous 1/k of the model's
flat fp32 weights) and the same bytes on the wire (each worker pushes its
gradient, M bytes, and pulls the weights, M bytes), with nothing else: no
parts, no control messages, no checks, no versions, no retries. A worker
(``host_worker.py raw-ps``) keeps its parameters and gradients in one flat
buffer each; per step it sends each server its range of the gradient
(``sendall`` from the tensor's memory) and reads the weights straight into
the parameters (``recv_into``), one thread per server. A server reads each
worker's gradient into that worker's buffer (one thread a worker), and once
all are in, sums them, takes the SGD step (lr 0.01, the mean gradient, as
DDP's average does) and sends the weights back to every worker.

What is left of such a step's CPU is the kernel's copies, torch's sum and
step, and the interpreter's few calls: the floor a parameter server written
in Python pays on this machine, measured the same way as the rows beside it.
Every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import sys
import threading
from typing import Any

import torch

HELLO = struct.Struct("!I")  # the worker's rank


def _bytes(t: torch.Tensor) -> memoryview:
    raw: Any = t.view(torch.uint8).numpy()
    return memoryview(raw)


def fill(sock: socket.socket, view: memoryview) -> None:
    """Read exactly ``len(view)`` bytes into ``view`` (EOF is an error)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def serve(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = a.hi - a.lo
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((a.host, 0))
    listener.listen(a.world)
    listener.settimeout(a.timeout)
    print(f"READY {a.host}:{listener.getsockname()[1]}", flush=True)
    weights: torch.Tensor | None = None
    conns: dict[int, socket.socket] = {}
    while len(conns) < a.world:
        sock, _ = listener.accept()
        sock.settimeout(a.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(HELLO.size)
        fill(sock, memoryview(head))
        conns[HELLO.unpack(head)[0]] = sock
    listener.close()
    # The first worker's initial weights are everyone's (every worker builds the same model from seed 0).
    weights = torch.empty(n, dtype=torch.float32)
    fill(conns[0], _bytes(weights))
    grads = {r: torch.empty(n, dtype=torch.float32) for r in conns}
    total = torch.empty(n, dtype=torch.float32)
    lr = 0.01 / a.world

    def apply() -> None:  # the barrier's action: the step, in the last thread to arrive
        assert weights is not None
        total.copy_(grads[0])
        for r in range(1, a.world):
            total.add_(grads[r])
        weights.add_(total, alpha=-lr)

    pushed = threading.Barrier(a.world, action=apply, timeout=a.timeout)
    failures: list[BaseException] = []

    def serve_worker(rank: int) -> None:
        sock, mine = conns[rank], _bytes(grads[rank])
        out = _bytes(weights)  # type: ignore[arg-type]
        try:
            sock.sendall(out)  # the starting weights
            for _ in range(a.steps):
                fill(sock, mine)
                pushed.wait()
                sock.sendall(out)
        except BaseException as e:  # noqa: BLE001 - reported below; the barrier breaks for the others
            failures.append(e)
            pushed.abort()

    threads = [threading.Thread(target=serve_worker, args=(r,), daemon=True) for r in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.timeout * (a.steps + 1))
    for s in conns.values():
        s.close()
    if failures:
        print(f"raw_ps server: {failures[0]!r}", file=sys.stderr)
        return 1
    # Stay until the driver stops us (SIGTERM, its default action: no interpreter teardown), so that the
    # driver's last reading of this process's CPU holds the steps and not the exit.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("DONE", flush=True)
    signal.sigtimedwait({signal.SIGTERM}, a.timeout)
    return 0


class Client:
    """A worker's side (``host_worker.py raw-ps``): flat parameters and gradients, one thread per server."""

    def __init__(self, model: torch.nn.Module, addresses: list[str], rank: int, timeout: float) -> None:
        params = [p for p in model.parameters()]
        total = sum(p.numel() for p in params)
        self.flat = torch.empty(total, dtype=torch.float32)
        self.grad = torch.zeros(total, dtype=torch.float32)
        at = 0
        for p in params:  # parameters and gradients become views of the flat buffers
            k = p.numel()
            self.flat[at:at + k].copy_(p.data.view(-1))
            p.data = self.flat[at:at + k].view(p.shape)
            p.grad = self.grad[at:at + k].view(p.shape)
            at += k
        k = len(addresses)
        bounds = [total * j // k for j in range(k + 1)]
        self.ranges = list(zip(bounds, bounds[1:]))
        self.socks = []
        for address in addresses:
            host, _, port = address.rpartition(":")
            s = socket.create_connection((host, int(port)), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(HELLO.pack(rank))
            self.socks.append(s)
        if rank == 0:
            for s, (lo, hi) in zip(self.socks, self.ranges):
                s.sendall(_bytes(self.flat[lo:hi]))
        for s, (lo, hi) in zip(self.socks, self.ranges):
            fill(s, _bytes(self.flat[lo:hi]))
        self._go = threading.Barrier(k + 1, timeout=timeout)
        self._done = threading.Barrier(k + 1, timeout=timeout)
        self._failures: list[BaseException] = []
        self._stop = False
        self._threads = [threading.Thread(target=self._serve, args=(j,), daemon=True) for j in range(k)]
        for t in self._threads:
            t.start()

    def _serve(self, j: int) -> None:
        sock, (lo, hi) = self.socks[j], self.ranges[j]
        up, down = _bytes(self.grad[lo:hi]), _bytes(self.flat[lo:hi])
        try:
            while True:
                self._go.wait()
                if self._stop:
                    return
                sock.sendall(up)
                fill(sock, down)
                self._done.wait()
        except BaseException as e:  # noqa: BLE001 - raised by step()
            self._failures.append(e)
            self._done.abort()

    def step(self) -> None:
        """Push the gradient, pull the weights (into the parameters' own storage)."""
        self._go.wait()
        self._done.wait()
        if self._failures:
            raise RuntimeError(f"raw parameter server: {self._failures[0]!r}")

    def zero_grad(self) -> None:
        self.grad.zero_()

    def close(self) -> None:
        self._stop = True
        try:
            self._go.wait()
        except threading.BrokenBarrierError:
            pass
        for t in self._threads:
            t.join(5.0)
        for s in self.socks:
            s.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--world", type=int, required=True, help="workers")
    p.add_argument("--lo", type=int, required=True, help="first element of the flat model this server owns")
    p.add_argument("--hi", type=int, required=True, help="one past its last")
    p.add_argument("--steps", type=int, required=True, help="steps to serve (warm-up and timed)")
    p.add_argument("--timeout", type=float, default=120.0)
    return serve(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
