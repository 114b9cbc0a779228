#!/usr/bin/env python
"""The data connection against a raw socket pair: CPU seconds per MB and MB/s, alternating rounds.

Two ``shardps server`` processes (``LocalCluster(2, processes=True)``), one
worker in this process (worker/datapath/dataconn.py: its calls as frames on one
connection per server process, ``shm=False``). The reference
(``raw``): the same bytes over a plain socket pair between this process and
a child, each end receiving with ``recv_into`` into a buffer of its own
and sending from it (the kernel's copies, nothing else). After
``--warmup`` untimed rounds, ``--repeats`` rounds of push then pull per
worker and one raw round trip, the order rotated each round so that
background load hits all alike. Per round: wall time, and the CPU time of
this process plus the other end's processes, to the nanosecond
(``proccpu.precise_cpu``: /proc's ticks of 10 ms are too coarse for a
round), both sides of the transport. Reported: medians of CPU-s per MB
moved (push + pull: 2 x model bytes) and MB/s, and the ratios; the load
average beside them (the machine is shared). ``--tls``: the servers and
both workers under TLS (a CA and a server certificate made with
``openssl`` in a temporary folder): the gRPC channel and the data connection
both encrypted; the raw pairs stay plain.

A second reference (``raw+work``) adds to the raw pair the work the path
must do with the bytes, in torch, as the product does it, and nothing
else: this end checks each gradient for inf/nan before sending it (the
worker's ``found_inf``, which every shard must agree on); the other end (a
spawned process, torch's threads as a server's) receives it into a buffer,
checks each part of it (a shard's own check), takes the SGD step on its
weights (at ``lr = 0``, as the servers here) and sends them from their own
memory (as a shard's answer goes: server/datapath/reader.py ``read_lent``;
nothing steps them while they are sent); this end receives them into the
parameters' storage. What the
frames cost above ``raw+work`` is the path's own: parsing, checks a part,
versions, locks, threads.

``--paths`` picks which of frames, raw, raw+work run.

    .venv/bin/python benchmarks/tcppath.py [--mb 50] [--repeats 5] [--paths frames,raw,raw+work] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from guard import run_guarded
from proccpu import precise_cpu

MB = 1_000_000
PATHS = ("frames", "raw", "raw+work")
_CHILDREN: list[Any] = []


def _echo(sock: socket.socket, nbytes: int, rounds: int) -> None:
    """The raw reference's other end: receive ``nbytes`` into a buffer, send them back, ``rounds`` times."""
    buf = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        _fill(sock, buf)
        sock.sendall(buf)


def _echo_work(address: tuple[str, int], nbytes: int, rounds: int, pieces: int) -> None:
    """``raw+work``'s other end (a spawned process): per round, receive the gradient, check it for inf/nan,
    step SGD on its weights, send them from their own memory (the module docstring)."""
    import torch

    from shardps.protos.codec import all_finite
    from shardps.server.app import default_torch_threads

    torch.set_num_threads(default_torch_threads())  # as a ``shardps server`` process
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    grad = torch.empty(nbytes // 4)
    weights = torch.zeros(nbytes // 4)
    gview, wview = memoryview(grad.numpy()).cast("B"), memoryview(weights.numpy()).cast("B")
    for _ in range(rounds):
        _fill(sock, gview)
        if not all(all_finite(g) for g in grad.chunk(pieces)):  # as a shard checks each tensor's part
            raise ValueError("raw+work: a gradient with an inf/nan")
        weights.add_(grad, alpha=-0.0)
        sock.sendall(wview)
    sock.close()


def _fill(sock: socket.socket, view: memoryview) -> None:
    n = 0
    while n < len(view):
        k = sock.recv_into(view[n:])
        if not k:
            raise ConnectionError("the raw reference's other end closed")
        n += k


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import shardps

    gen = torch.Generator().manual_seed(0)
    n = int(args.mb * MB / 4 / 1024)
    shapes = {f"w{i}": (n // 8, 1024) for i in range(8)}
    weights = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    outs = {k: torch.empty(s) for k, s in shapes.items()}
    nbytes = sum(t.numel() * 4 for t in weights.values())
    ours, theirs = socket.socketpair(socket.AF_UNIX) if args.unix else _tcp_pair()
    for sk in (ours, theirs):
        sk.settimeout(args.rpc_timeout)
    echo = multiprocessing.get_context("fork").Process(target=_echo, args=(theirs, nbytes, args.warmup + args.repeats),
                                                       daemon=True)
    echo.start()
    theirs.close()
    _CHILDREN.append(echo)
    raw_buf = memoryview(bytearray(nbytes))
    flat_grad = torch.cat([g.reshape(-1) for g in grads.values()])
    raw_src = memoryview(flat_grad.numpy()).cast("B")
    flat_out = torch.empty(nbytes // 4)
    work_dst = memoryview(flat_out.numpy()).cast("B")
    with socket.socket() as listener:  # raw+work's other end: a spawned process (no torch across a fork)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(args.rpc_timeout)
        shard_end = multiprocessing.get_context("spawn").Process(
            target=_echo_work, args=(listener.getsockname(), nbytes, args.warmup + args.repeats, len(grads)),
            daemon=True)
        shard_end.start()
        _CHILDREN.append(shard_end)
        work, _ = listener.accept()
    work.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    work.settimeout(args.rpc_timeout)
    from shardps.protos.codec import all_finite
    from shardps.protos.security import Security

    tmp = tempfile.TemporaryDirectory(prefix="shardps-tcppath-")
    server_sec = client_sec = None
    if args.tls:
        server_sec, client_sec = _pki(Path(tmp.name))
    with tmp, shardps.LocalCluster(2, processes=True, max_wait_s=args.rpc_timeout,
                                   security=server_sec or Security()) as cluster:
        _CHILDREN.extend(getattr(cluster, "_procs", []))
        pids = [p.pid for p in getattr(cluster, "_procs", [])]
        clients = {}
        if "frames" in args.paths:
            c = shardps.connect(cluster.addresses, worker_id=0, num_workers=1, shm=False,
                                timeout=args.rpc_timeout, security=client_sec or Security())
            c.register(weights, shardps.optim.SGD(lr=0.0), sync="asp")
            kinds = {type(p).__name__ for p in c.paths}
            if kinds != {"ConnPath"}:
                raise RuntimeError(f"frames: the worker took {kinds}")
            clients["frames"] = c
        steps = dict.fromkeys(clients, 0)
        names = [n for n in PATHS if n in args.paths]
        rows: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "wall": []} for k in names}
        for r in range(args.warmup + args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                ends = [echo.pid] if name == "raw" else [shard_end.pid] if name == "raw+work" else pids
                assert ends[0] is not None
                cpu0, t0 = precise_cpu(ends), time.perf_counter()  # type: ignore[arg-type]
                if name == "raw":
                    ours.sendall(raw_src)
                    _fill(ours, raw_buf)
                elif name == "raw+work":
                    if not all(all_finite(g) for g in grads.values()):  # as the worker checks each gradient
                        raise ValueError("raw+work: a gradient with an inf/nan")
                    work.sendall(raw_src)
                    _fill(work, work_dst)
                else:
                    c = clients[name]
                    c.push(grads, step=steps[name])
                    c.pull(out=outs)
                    steps[name] += 1
                cpu, wall = precise_cpu(ends) - cpu0, time.perf_counter() - t0  # type: ignore[arg-type]
                if r >= args.warmup:
                    rows[name]["cpu"].append(cpu)
                    rows[name]["wall"].append(wall)
        for c in clients.values():
            c.close()
    echo.join(30)
    shard_end.join(30)
    ours.close()
    work.close()
    moved = 2 * nbytes / MB
    res: dict[str, Any] = {"mb": nbytes / MB, "repeats": args.repeats, "load": os.getloadavg(), "tls": args.tls}
    for name, row in rows.items():
        res[name] = {"cpu_s_per_mb": statistics.median(row["cpu"]) / moved,
                     "mb_per_s": moved / statistics.median(row["wall"])}
    for a, b, key in (("frames", "raw", "frames_over_raw"),
                      ("frames", "raw+work", "frames_over_raw_work"), ("raw+work", "raw", "raw_work_over_raw")):
        if a in res and b in res:
            res[f"cpu_ratio_{key}"] = res[a]["cpu_s_per_mb"] / res[b]["cpu_s_per_mb"]
    return res


def _pki(d: Path) -> tuple[Any, Any]:
    """A CA and a server certificate for 127.0.0.1 in ``d``: (the servers' Security, the workers')."""
    from shardps.protos.security import Security

    def ossl(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
         "-subj", "/CN=tcppath CA")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=server")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "1", "-extfile", "server.ext")
    return (Security(tls_cert=str(d / "server.pem"), tls_key=str(d / "server.key")),
            Security(tls_ca=str(d / "ca.pem")))


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection (the raw reference: the path the data connection takes)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    for sk in (ours, theirs):
        sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


def report(res: dict[str, Any]) -> str:
    lines = [f"{res['mb']:.1f} MB model, push + pull, {res['repeats']} rounds each, alternating"
             f"{', TLS' if res['tls'] else ''}; "
             f"load {' '.join(f'{x:.1f}' for x in res['load'])}",
             f"{'path':8} {'CPU ms/MB (both ends)':>22} {'MB/s':>8}"]
    for name in PATHS:
        if name in res:
            lines.append(f"{name:8} {1000 * res[name]['cpu_s_per_mb']:>22.2f} {res[name]['mb_per_s']:>8.1f}")
    said = []
    for key, what in (("frames_over_raw", "frames / raw socket pair"), ("frames_over_raw_work", "frames / raw+work"),
                      ("raw_work_over_raw", "raw+work / raw")):
        if f"cpu_ratio_{key}" in res:
            said.append(f"{what}: CPU per MB x{res[f'cpu_ratio_{key}']:.2f}")
    lines.append("; ".join(said))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="model size in MB (10^6 bytes; default 50)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per path (default 5; the median counts)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--rpc-timeout", type=float, default=120.0, help="deadline of every RPC, seconds (default 120)")
    p.add_argument("--max-seconds", type=float, default=600.0, help="watchdog for the whole run (default 600)")
    p.add_argument("--tls", action="store_true", help="servers and workers under TLS (openssl makes the certificates)")
    p.add_argument("--unix", action="store_true", help="the raw reference on a Unix socket pair (default: TCP)")
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"which of {', '.join(PATHS)} to run (default all)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = p.parse_args(argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    unknown = [x for x in args.paths if x not in PATHS]
    if unknown or not args.paths:
        p.error(f"--paths: expected some of {', '.join(PATHS)}, got {', '.join(unknown) or 'none'}")
    res = run_guarded("tcppath", args.max_seconds, lambda: run(args), lambda: _CHILDREN)
    if res is None:
        return 1
    print(json.dumps(res) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
