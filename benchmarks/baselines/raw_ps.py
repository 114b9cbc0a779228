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

``--parts P`` (both ends): the same server cut as shardps cuts it, each
server's range in P parts, each part a message of its own: a worker sends
its parts in shardps's push order (round-robin over the servers, starting
at its rank) at most ``window`` unanswered at once, each as a 4-byte part
number and the part's bytes, checked for inf/nan (numpy's sum) before it
goes; a server reads each into that worker's buffer, checks it, and once
every worker's copy of the part is in (the thread of the last one), sums
them, steps, copies the part's weights into an answer buffer and sends
them to every worker (number and bytes); the worker's reading thread reads
them into the parameters. What shardps does a part beyond this (protobuf
control, versions and clocks, leases, the push's own answer, the objects and
threads of a general path) is its overhead above a Python floor for the
same schedule (benchmarks/call_cpu.py ``--systems``).

``--native`` (both ends, with ``--parts``, 1 included): the same schedule and work with the per-part loop
compiled (raw_ps_native.c, built by native.py: a C compiler is needed), Python setting up the sockets and
the first weights, each step one call that lets the interpreter's lock go. Its sum and step are plain C
loops, its check a test of each element's exponent bits, and the answer is copied as above: what that
granularity costs a parameter server whose per-part loop is out of the interpreter, on both ends.
``--py-step`` (a server with ``--native``): each complete part's sum, step and copy done by a call into
Python, in torch as above, the rest in C: what a compiled data plane that keeps its optimizers in torch,
one call into the interpreter a part, would cost.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import signal
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import torch

HELLO = struct.Struct("!I")  # the worker's rank
PART = struct.Struct("!I")  # --parts: a part's number before its bytes, both ways


def cuts(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) in ``parts`` contiguous pieces."""
    n = hi - lo
    return [(lo + n * i // parts, lo + n * (i + 1) // parts) for i in range(parts)]


def finite(t: torch.Tensor) -> bool:
    """No inf/nan in a CPU fp32 tensor: numpy's sum in this thread (as shardps's check, protos/codec.py)."""
    raw: Any = t.numpy()
    return math.isfinite(float(raw.sum()))


def send_frame(sock: socket.socket, head: bytes, body: memoryview) -> None:
    """A part's number and bytes, in one ``sendmsg`` where the socket takes them."""
    n = sock.sendmsg([head, body])
    if n < len(head):
        sock.sendall(head[n:])
        n = len(head)
    if n - len(head) < len(body):
        sock.sendall(body[n - len(head):])


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
    if a.native:
        return _serve_native(a, conns, weights, grads, total, lr)
    if a.parts > 1:
        return _serve_parts(a, conns, weights, grads, total, lr)

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

    return _run(a, conns, serve_worker, failures)


def _run(a: argparse.Namespace, conns: dict[int, socket.socket], serve_worker: Any,
         failures: list[BaseException]) -> int:
    threads = [threading.Thread(target=serve_worker, args=(r,), daemon=True) for r in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.timeout * (a.steps + 1))
    return _finish(a, conns, failures)


def _finish(a: argparse.Namespace, conns: dict[int, socket.socket], failures: list[BaseException]) -> int:
    if failures:
        for s in conns.values():
            s.close()
        print(f"raw_ps server: {failures[0]!r}", file=sys.stderr)
        return 1
    # Stay until the driver stops us (SIGTERM, its default action: no interpreter teardown), so that the
    # driver's last reading of this process's CPU holds the steps and not the exit. The connections stay
    # open until then: closed here, the last answers of --parts were sometimes lost to the workers.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("DONE", flush=True)
    signal.sigtimedwait({signal.SIGTERM}, a.timeout)
    for s in conns.values():
        s.close()
    return 0


def _serve_parts(a: argparse.Namespace, conns: dict[int, socket.socket], weights: torch.Tensor,
                 grads: dict[int, torch.Tensor], total: torch.Tensor, lr: float) -> int:
    """``--parts``: each part a message of its own, stepped once every worker's copy is in (module docstring)."""
    pieces = cuts(0, weights.numel(), a.parts)
    answer = weights.clone()
    counts = [0] * a.parts
    lock = threading.Lock()
    sending = {r: threading.Lock() for r in conns}
    failures: list[BaseException] = []

    def arrived(part: int) -> None:
        lo, hi = pieces[part]
        with lock:
            counts[part] += 1
            if counts[part] < a.world:
                return
            counts[part] = 0
        t = total[lo:hi]
        t.copy_(grads[0][lo:hi])
        for r in range(1, a.world):
            t.add_(grads[r][lo:hi])
        weights[lo:hi].add_(t, alpha=-lr)
        answer[lo:hi].copy_(weights[lo:hi])
        head, body = PART.pack(part), _bytes(answer[lo:hi])
        for r, sock in conns.items():
            with sending[r]:
                send_frame(sock, head, body)

    def serve_worker(rank: int) -> None:
        sock, mine = conns[rank], grads[rank]
        head = bytearray(PART.size)
        try:
            with sending[rank]:
                sock.sendall(_bytes(weights))  # the starting weights
            for _ in range(a.steps * a.parts):
                fill(sock, memoryview(head))
                (part,) = PART.unpack(head)
                lo, hi = pieces[part]
                fill(sock, _bytes(mine[lo:hi]))
                if not finite(mine[lo:hi]):
                    raise ValueError(f"worker {rank}: part {part} holds an inf or nan")
                arrived(part)
        except BaseException as e:  # noqa: BLE001 - reported by _run
            failures.append(e)

    return _run(a, conns, serve_worker, failures)


def _serve_native(a: argparse.Namespace, conns: dict[int, socket.socket], weights: torch.Tensor,
                  grads: dict[int, torch.Tensor], total: torch.Tensor, lr: float) -> int:
    """``--native``: every step in raw_ps_native.c's ``rps_serve`` (module docstring)."""
    from baselines import native

    lib = native.library()
    for sock in conns.values():
        sock.sendall(_bytes(weights))  # the starting weights (each worker reads its servers in order)
    world, pieces = a.world, cuts(0, weights.numel(), a.parts)
    answer = weights.clone()
    fds = (ctypes.c_int * world)(*(conns[r].fileno() for r in range(world)))
    gptrs = (ctypes.c_void_p * world)(*(grads[r].data_ptr() for r in range(world)))
    lo = (ctypes.c_long * a.parts)(*(p[0] for p in pieces))
    hi = (ctypes.c_long * a.parts)(*(p[1] for p in pieces))
    failures: list[BaseException] = []

    def step(part: int) -> int:  # --py-step: the Python floor's arrived(), but for the count and the sends
        try:
            lo, hi = pieces[part]
            t = total[lo:hi]
            t.copy_(grads[0][lo:hi])
            for r in range(1, world):
                t.add_(grads[r][lo:hi])
            weights[lo:hi].add_(t, alpha=-lr)
            answer[lo:hi].copy_(weights[lo:hi])
            return 0
        except BaseException as e:  # noqa: BLE001 - reported by _finish
            failures.append(e)
            return 1

    callback = native.STEP(step) if a.py_step else native.STEP()
    rc = lib.rps_serve(world, fds, weights.data_ptr(), answer.data_ptr(), total.data_ptr(), gptrs, a.parts, lo, hi,
                       a.steps, lr, int(a.timeout * 1000), callback)
    return _finish(a, conns, failures + [RuntimeError(f"native server: {native.error()}")] if rc else [])


class Client:
    """A worker's side (``host_worker.py raw-ps``): flat parameters and gradients, one thread per server."""

    def __init__(self, model: torch.nn.Module, addresses: list[str], rank: int, timeout: float, parts: int = 1,
                 window: int | None = None, native: bool = False) -> None:
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
        self.parts, self.timeout, self.native = parts, timeout, native
        if native:  # (module docstring) each step one call into raw_ps_native.c
            self._native_setup(rank, window)
            self._threads = []
        elif parts > 1:  # (module docstring) a reading thread per server; the caller's thread sends the parts
            self.pieces = [cuts(lo, hi, parts) for lo, hi in self.ranges]
            start = rank % k
            self.order = [(j, i) for i in range(parts) for j in [*range(start, k), *range(start)]]
            self._window = threading.BoundedSemaphore(window or len(self.order))
            self._left = 0
            self._cv = threading.Condition()
            self._threads = [threading.Thread(target=self._answers, args=(j,), daemon=True) for j in range(k)]
        else:
            self._threads = [threading.Thread(target=self._serve, args=(j,), daemon=True) for j in range(k)]
        for t in self._threads:
            t.start()

    def _native_setup(self, rank: int, window: int | None) -> None:
        from baselines import native

        self._lib = native.library()
        k, parts = len(self.socks), self.parts
        pieces = [piece for lo, hi in self.ranges for piece in cuts(lo, hi, parts)]  # [j * parts + i]
        start = rank % k
        order = [(j, i) for i in range(parts) for j in [*range(start, k), *range(start)]]
        self._c_fds = (ctypes.c_int * k)(*(s.fileno() for s in self.socks))
        self._c_lo = (ctypes.c_long * len(pieces))(*(p[0] for p in pieces))
        self._c_hi = (ctypes.c_long * len(pieces))(*(p[1] for p in pieces))
        self._c_order = (ctypes.c_int * (2 * len(order)))(*(x for pair in order for x in pair))
        self._c_window = window or len(order)

    def _step_native(self) -> None:
        from baselines import native

        rc = self._lib.rps_step(len(self.socks), self._c_fds, self.grad.data_ptr(), self.flat.data_ptr(),
                                self.grad.numel(), self.parts, self._c_lo, self._c_hi, self._c_order,
                                self._c_window, int(self.timeout * 1000))
        if rc:
            raise RuntimeError(f"raw parameter server (native): {native.error()}")

    def _answers(self, j: int) -> None:
        """--parts: server ``j``'s answers, each part's weights read into the parameters."""
        sock, head = self.socks[j], bytearray(PART.size)
        try:
            while True:
                fill(sock, memoryview(head))
                (part,) = PART.unpack(head)
                lo, hi = self.pieces[j][part]
                fill(sock, _bytes(self.flat[lo:hi]))
                self._window.release()
                with self._cv:
                    self._left -= 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised by step(); a closed socket ends the thread
            if not self._stop:
                self._failures.append(e)
            with self._cv:
                self._cv.notify_all()

    def _step_parts(self) -> None:
        if not finite(self.grad):  # the worker's check of its gradient, as shardps's before it pushes
            raise ValueError("raw parameter server: the gradient holds an inf or nan")
        with self._cv:
            self._left = len(self.order)
        for j, i in self.order:
            if not self._window.acquire(timeout=self.timeout):
                raise TimeoutError(f"raw parameter server: no answer within {self.timeout}s")
            lo, hi = self.pieces[j][i]
            send_frame(self.socks[j], PART.pack(i), _bytes(self.grad[lo:hi]))
        with self._cv:
            if not self._cv.wait_for(lambda: self._left == 0 or bool(self._failures), self.timeout):
                raise TimeoutError(f"raw parameter server: {self._left} parts unanswered after {self.timeout}s")
            if self._left:  # (a server that closes after the last step's answers is no failure)
                raise RuntimeError(f"raw parameter server: {self._left} of {len(self.order)} parts unanswered: "
                                   f"{self._failures[0]!r}")

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
        if self.native:
            self._step_native()
            return
        if self.parts > 1:
            self._step_parts()
            return
        self._go.wait()
        self._done.wait()
        if self._failures:
            raise RuntimeError(f"raw parameter server: {self._failures[0]!r}")

    def zero_grad(self) -> None:
        self.grad.zero_()

    def close(self) -> None:
        self._stop = True
        if self.native:
            pass
        elif self.parts > 1:
            for s in self.socks:
                s.shutdown(socket.SHUT_RDWR)  # the reading threads end
        else:
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
    p.add_argument("--parts", type=int, default=1, help="parts of this server's range, each a message (default 1)")
    p.add_argument("--native", action="store_true", help="the per-part loop in C (raw_ps_native.c; needs gcc)")
    p.add_argument("--py-step", action="store_true", help="with --native: each part's sum and step in Python")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # baselines.native
    return serve(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
