"""What a large Pull costs the other requests of its shard: framing under the lock vs by a thread outside it.

    .venv/bin/python benchmarks/pull_lock.py [--mb 50] [--repeats 7] [--e2e-repeats 10]

One ShardStore (no network) holding --mb MB of fp32 weights. Before each
Pull a step moves the version (SGD, lr=0: the weights stay) and one Pull of all of
them is answered the way the Pull handler asks (``read(..., messages=True)``
and every response taken), alone, then while a second thread asks the store
for its stats every millisecond (a request that needs the store's lock,
like a heartbeat or the first step of another worker's Push). Rounds alternate between the two ways a
Pull is framed: under the store's lock (``frame_inline_bytes`` above the
Pull's size: how every Pull was framed before) and by a thread of its own
outside the lock (server/datapath/reader.py; the default for Pulls over 2 MiB).

Prints, for each way, the median over Pulls of: the time to the Pull's
first response (when the handler can start sending) and to its last, alone;
then, with the stats() requests coming every millisecond, the time to its
last response and the longest a request waited; and the ratios outside /
under the lock (lower is better).

Then end to end, on the data connection: four ``shardps server`` processes, one shard
each: one as it comes (default), one framing every Pull under the lock
(``SHARDPS_FRAME_INLINE_BYTES`` above any Pull), one keeping glibc's
per-thread malloc arenas (``MALLOC_ARENA_MAX`` set: see keep_freed_memory in
server/app.py), one with both (how Pulls were served before); one client
registering --mb MB on each (asp, SGD lr=0) and, taking them in turn,
pushing (a new version) and timing a Pull of all the weights (median ms, and
each as a multiple of the default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

from shardps import optim
from shardps.protos import codec
from shardps.server.app import keep_freed_memory
from shardps.server.store import ShardStore, TensorSpec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0, help="weights on the shard, MB (default 50)")
    ap.add_argument("--repeats", type=int, default=7, help="Pulls of each way (default 7; the median counts)")
    ap.add_argument("--e2e-repeats", type=int, default=10,
                    help="timed Pulls of each way end to end (default 10, after 2 untimed; 0: skip that part)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a `shardps server` on 2 cores
    keep_freed_memory()  # as a `shardps server` does (server/app.py)
    n = int(args.mb * 1e6 / 4)
    rows = max(8, n // 1024)
    names = [f"t{i}" for i in range(8)]
    st = ShardStore(0, 1, sync="asp", num_workers=1)
    st.path.register_tensors([TensorSpec(nm, (rows // 8, 1024), codec.to_wire_dtype(torch.float32), optim.SGD(lr=0.0),
                                    ((0, rows // 8 * 1024),)) for nm in names],
                        {(nm, 0): torch.randn(rows // 8 * 1024) for nm in names})
    st.leases.register(0)
    zeros = {(nm, 0): torch.zeros(rows // 8 * 1024) for nm in names}
    default_inline = st.reader.frame_inline_bytes
    step = 0

    def one_pull(outside: bool, probe: bool) -> tuple[float, float, float]:
        """(ms to the first response, to the last, longest stats() wait or 0 without ``probe``)."""
        nonlocal step
        st.reader.frame_inline_bytes = default_inline if outside else 1 << 62
        st.path.submit(0, step, st.job.version, {k: v.clone() for k, v in zeros.items()})  # a new version: framed anew
        step += 1
        done = threading.Event()
        waits: list[float] = [0.0]

        def ask() -> None:  # one request every millisecond, as heartbeats and other workers' pushes come
            while not done.wait(0.001):
                t = time.perf_counter()
                st.stats()
                waits.append(time.perf_counter() - t)

        prober = threading.Thread(target=ask)
        if probe:
            prober.start()
        t0 = time.perf_counter()
        first = 0.0
        for i, _ in enumerate(st.reader.read(names, None, messages=True)[1]):
            if i == 0:
                first = time.perf_counter() - t0
        last = time.perf_counter() - t0
        done.set()
        if probe:
            prober.join()
        return first * 1e3, last * 1e3, max(waits) * 1e3

    got: dict[tuple[bool, bool], list[tuple[float, float, float]]] = {}
    for outside in (False, True):  # warm-up
        one_pull(outside, False)
    for _ in range(args.repeats):
        for outside in (False, True):
            for probe in (False, True):
                got.setdefault((outside, probe), []).append(one_pull(outside, probe))

    def med(outside: bool, probe: bool, i: int) -> float:
        return statistics.median(r[i] for r in got[(outside, probe)])

    print(f"{args.mb:g} MB on one shard, one Pull at a time, median of {args.repeats} Pulls each (ms):")
    print(f"{'framed':16}{'first response':>16}{'last response':>15}{'with requests: last':>21}"
          f"{'longest request wait':>22}")
    for outside, label in ((False, "under the lock"), (True, "outside it")):
        print(f"{label:16}{med(outside, False, 0):16.2f}{med(outside, False, 1):15.2f}{med(outside, True, 1):21.2f}"
              f"{med(outside, True, 2):22.2f}")
    def ratio(p: bool, i: int, w: int) -> str:  # a wait of 0 ms (no request waited): no ratio
        base = med(False, p, i)
        return f"{med(True, p, i) / base:{w}.2f}" if base > 0 else f"{'-':>{w}}"

    print(f"{'ratio':16}" + "".join(ratio(p, i, w) for p, i, w in ((False, 0, 16), (False, 1, 15), (True, 1, 21),
                                                                    (True, 2, 22))))
    if args.e2e_repeats > 0:
        end_to_end(args.mb, args.e2e_repeats)
    return 0


# The servers of the end-to-end part: (label, environment they start with). MALLOC_ARENA_MAX set keeps glibc's
# per-thread malloc arenas (server/app.py keep_freed_memory otherwise asks for one).
SERVERS = (("default", {}),
           ("framed under the lock", {"SHARDPS_FRAME_INLINE_BYTES": str(1 << 62)}),
           ("glibc's thread arenas", {"MALLOC_ARENA_MAX": "8"}),
           ("both (as before)", {"SHARDPS_FRAME_INLINE_BYTES": str(1 << 62), "MALLOC_ARENA_MAX": "8"}))


def end_to_end(mb: float, repeats: int) -> None:
    import shardps
    from shardps.deploy.local import LocalCluster

    n = max(1, int(mb * 1e6 / 4) // 8)
    shapes = {f"t{i}": (n,) for i in range(8)}
    clusters: dict[str, LocalCluster] = {}
    clients: dict[str, shardps.PSClient] = {}
    saved = dict(os.environ)
    try:
        for label, environ in SERVERS:
            os.environ.clear()
            os.environ.update(saved, **environ)  # what the `shardps server` started here reads
            clusters[label] = LocalCluster(1, processes=True).start()
            os.environ.clear()
            os.environ.update(saved)
            c = clients[label] = shardps.connect(clusters[label].addresses, 0, 1, shm=False, timeout=60.0)
            c.register({k: torch.zeros(s) for k, s in shapes.items()}, shardps.optim.SGD(lr=0.0), sync="asp")
        out = {k: torch.empty(s) for k, s in shapes.items()}
        grads = {k: torch.zeros(s) for k, s in shapes.items()}
        times: dict[str, list[float]] = {label: [] for label in clients}
        steps = dict.fromkeys(clients, 0)
        labels = list(clients)
        for r in range(repeats + 2):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:  # each goes first in turn
                c = clients[label]
                c.push(grads, step=steps[label])  # a new version: the Pull is framed anew
                steps[label] += 1
                t = time.perf_counter()
                c.pull(out=out)
                if r >= 2:
                    times[label].append((time.perf_counter() - t) * 1e3)
            print(f"end to end: round {r + 1}/{repeats + 2}", file=sys.stderr)
        base = statistics.median(times["default"])
        print(f"end to end (data connection): {mb:g} MB pulled from one shard process, median of {repeats} Pulls each")
        for label, _ in SERVERS:
            m = statistics.median(times[label])
            print(f"  {label:24}{m:8.1f} ms   x{m / base:.2f} of default")
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for c in clients.values():
            c.close()
        for cl in clusters.values():
            cl.stop()


if __name__ == "__main__":
    raise SystemExit(main())
