"""Row tables: rows/s pulled and pushed+applied, and the bytes that cross the wire.

    .venv/bin/python benchmarks/rows.py                     # 1M rows of dim 64, 2 server processes
    .venv/bin/python benchmarks/rows.py --rows 200000 --json

Starts ``--shards`` server processes (``shardps.LocalCluster(processes=True)``),
registers a table of ``--dim`` floats (SparseAdam), and times, median of
``--repeats``: the first pull of ``--rows`` distinct keys (rows created on
first touch), a pull of rows held, and a push of their gradients with the
optimizer step applied on the servers. Keys are random 64-bit ids. Bytes
on the wire: the key and row payload the client sent and received, against
distinct keys x dim x 4 (protobuf framing adds a few bytes a message of up
to 1 MiB, not counted). Prints rows/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import shardps
from shardps.optim import SparseAdam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="distinct keys per request")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cluster = shardps.LocalCluster(a.shards, processes=True).start()
    try:
        with shardps.connect(cluster.addresses, timeout=600) as client:
            client.rows.register("bench", a.dim, optimizer=SparseAdam(lr=1e-3))
            keys = torch.randint(-(2**63), 2**63 - 1, (a.rows,), generator=torch.Generator().manual_seed(0))
            keys = torch.unique(keys)
            n = len(keys)
            grads = torch.randn(n, a.dim)
            t0 = time.perf_counter()
            first = client.rows.pull("bench", keys)
            create_s = time.perf_counter() - t0
            pull_s, push_s = [], []
            for step in range(a.repeats):
                client.rows.wire_bytes = 0
                t0 = time.perf_counter()
                again = client.rows.pull("bench", keys)
                pull_s.append(time.perf_counter() - t0)
                pull_bytes = client.rows.wire_bytes
                client.rows.wire_bytes = 0
                t0 = time.perf_counter()
                client.rows.push("bench", keys, grads, step)
                push_s.append(time.perf_counter() - t0)
                push_bytes = client.rows.wire_bytes
            assert again.shape == first.shape == (n, a.dim)
    finally:
        cluster.stop()
    payload = n * a.dim * 4
    out = {
        "rows": n, "dim": a.dim, "shards": a.shards, "cpus": os.cpu_count(),
        "create_pull_rows_per_s": n / create_s,
        "pull_rows_per_s": n / statistics.median(pull_s),
        "push_apply_rows_per_s": n / statistics.median(push_s),
        "pull_wire_ratio": pull_bytes / payload, "push_wire_ratio": push_bytes / payload,
        "pull_s": pull_s, "push_s": push_s, "create_s": create_s,
    }
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{n} rows x {a.dim}: first pull {out['create_pull_rows_per_s']:,.0f} rows/s, pull "
              f"{out['pull_rows_per_s']:,.0f} rows/s, push+apply {out['push_apply_rows_per_s']:,.0f} rows/s; "
              f"wire / (rows x dim x 4): pull {out['pull_wire_ratio']:.3f}, push {out['push_wire_ratio']:.3f}")


if __name__ == "__main__":
    main()
