"""Row tables: rows/s pulled and pushed+applied, and the bytes that cross the wire.

    .venv/bin/python benchmarks/rows.py                     # 1M rows of dim 64, 2 server processes
    .venv/bin/python benchmarks/rows.py --rows 200000 --json
    .venv/bin/python benchmarks/rows.py --index             # the shard's tables alone, two indexes compared

Starts ``--shards`` server processes (``shardps.LocalCluster(processes=True)``),
registers a table of ``--dim`` floats (SparseAdam), and times, median of
``--repeats``: the first pull of ``--rows`` distinct keys (rows created on
first touch), a pull of rows held, and a push of their gradients with the
optimizer step applied on the servers. Keys are random 64-bit ids, sorted
(``torch.unique``) or, with ``--shuffled``, in a random order. Bytes
on the wire: the key and row payload the client sent and received, against
distinct keys x dim x 4 (protobuf framing adds a few bytes a message of up
to 1 MiB, not counted). Prints rows/s for each and the ratio, and the CPU
seconds (user + system) the client and the servers spent together per 1M
rows pulled and pushed: the machine's other work moves that far less than
the wall time (it can still cost cache misses and switches).

``--index``: no servers; one shard's ``RowTables`` in this process, the
key -> slot index of server/rows/index.py (``KeyIndex``) against a Python
dict (``DictIndex``, what the tables used before), on the same keys, the
two runs interleaved ``--repeats`` times, each first as often (medians): rows/s of the first
pull, a pull of rows held and a push + SparseAdam step, and the bytes the
shard allocates per row (rows, optimizer state, keys, versions, last
steps and the index, at the capacity they have) against the raw row bytes
(dim x 4 + state + the 8-byte key). Ratios of one process, under one load:
the machine's share moves both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from proccpu import cpu_seconds

import shardps
from shardps.optim import SparseAdam


def index_compare(rows: int, dim: int, repeats: int) -> dict[str, object]:
    """Both indexes on one shard's tables, in this process (see the module)."""
    import numpy as np

    from shardps.protos.optim import SparseAdam as SparseAdamSpec
    from shardps.protos.rows import RowTableSpec
    from shardps.server.rows.index import DictIndex, KeyIndex
    from shardps.server.rows.tables import RowTables

    keys = np.unique(np.random.default_rng(0).integers(-(2**63), 2**63 - 1, rows, dtype=np.int64).view(np.uint64))
    np.random.default_rng(1).shuffle(keys)
    grads = torch.randn(len(keys), dim)
    times: dict[str, dict[str, list[float]]] = {}
    memory: dict[str, float] = {}
    for rep in range(repeats):
        both = (("dict", DictIndex), ("array", KeyIndex))
        for name, index in both if rep % 2 == 0 else both[::-1]:  # each goes first as often
            tables = RowTables(index=index)
            tables.register(RowTableSpec("t", dim, SparseAdamSpec(lr=1e-3)))
            got = times.setdefault(name, {"create": [], "pull": [], "push": []})
            for what, fn in (("create", lambda tb=tables: tb.pull("t", dim, keys)),
                             ("pull", lambda tb=tables: tb.pull("t", dim, keys)),
                             ("push", lambda tb=tables, r=rep: tb.push("t", dim, keys, grads, step=r))):
                t0 = time.perf_counter()
                fn()
                got[what].append(time.perf_counter() - t0)
            t = tables.tables["t"]
            allocated = (t.weights.numel() * 4 + sum(st.numel() * 4 for st in t.state.values())
                         + len(t.keys) * 8 + t.last.numel() * 8 + t.updates.numel() * 8 + t.index.nbytes())
            memory[name] = allocated / t.size
    state = 2 * dim * 4
    raw = dim * 4 + state + 8
    out: dict[str, object] = {"rows": len(keys), "dim": dim, "repeats": repeats, "raw_bytes_per_row": raw}
    for name in times:
        for what, ts in times[name].items():
            out[f"{name}_{what}_rows_per_s"] = len(keys) / statistics.median(ts)
        out[f"{name}_bytes_per_row"] = memory[name]
        out[f"{name}_memory_ratio"] = memory[name] / raw
    for what in ("create", "pull", "push"):
        out[f"speedup_{what}"] = statistics.median(times["dict"][what]) / statistics.median(times["array"][what])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="distinct keys per request")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shuffled", action="store_true", help="the keys in a random order (default: sorted)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--index", action="store_true", help="no servers: the two key indexes of a shard compared")
    a = ap.parse_args()
    if a.index:
        res = index_compare(a.rows, a.dim, a.repeats)
        if a.json:
            print(json.dumps(res, indent=1))
        else:
            for k, v in res.items():
                print(f"{k:32} {v:,.3f}" if isinstance(v, float) else f"{k:32} {v}")
        return
    cluster = shardps.LocalCluster(a.shards, processes=True).start()
    try:
        with shardps.connect(cluster.addresses, timeout=600) as client:
            client.rows.register("bench", a.dim, optimizer=SparseAdam(lr=1e-3))
            keys = torch.randint(-(2**63), 2**63 - 1, (a.rows,), generator=torch.Generator().manual_seed(0))
            keys = torch.unique(keys)  # sorted
            if a.shuffled:  # in the order a batch would bring them
                keys = keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(1))]
            n = len(keys)
            grads = torch.randn(n, a.dim)
            t0 = time.perf_counter()
            first = client.rows.pull("bench", keys)
            create_s = time.perf_counter() - t0
            pull_s, push_s, pull_cpu, push_cpu = [], [], [], []
            for step in range(a.repeats):
                client.rows.wire_bytes = 0
                c0, t0 = cpu_seconds(cluster.pids), time.perf_counter()
                again = client.rows.pull("bench", keys)
                pull_s.append(time.perf_counter() - t0)
                pull_cpu.append(cpu_seconds(cluster.pids) - c0)
                pull_bytes = client.rows.wire_bytes
                client.rows.wire_bytes = 0
                c0, t0 = cpu_seconds(cluster.pids), time.perf_counter()
                client.rows.push("bench", keys, grads, step)
                push_s.append(time.perf_counter() - t0)
                push_cpu.append(cpu_seconds(cluster.pids) - c0)
                push_bytes = client.rows.wire_bytes
            assert again.shape == first.shape == (n, a.dim)
    finally:
        cluster.stop()
    payload = n * a.dim * 4
    out = {
        "rows": n, "dim": a.dim, "shards": a.shards, "cpus": os.cpu_count(), "shuffled": a.shuffled,
        "create_pull_rows_per_s": n / create_s,
        "pull_rows_per_s": n / statistics.median(pull_s),
        "push_apply_rows_per_s": n / statistics.median(push_s),
        "pull_wire_ratio": pull_bytes / payload, "push_wire_ratio": push_bytes / payload,
        "pull_s": pull_s, "push_s": push_s, "create_s": create_s,
        "pull_cpu_s_per_1m_rows": statistics.median(pull_cpu) * 1e6 / n,
        "push_cpu_s_per_1m_rows": statistics.median(push_cpu) * 1e6 / n,
    }
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{n} rows x {a.dim}: first pull {out['create_pull_rows_per_s']:,.0f} rows/s, pull "
              f"{out['pull_rows_per_s']:,.0f} rows/s, push+apply {out['push_apply_rows_per_s']:,.0f} rows/s; "
              f"wire / (rows x dim x 4): pull {out['pull_wire_ratio']:.3f}, push {out['push_wire_ratio']:.3f}; CPU s "
              f"(client + servers) per 1M rows: pull {out['pull_cpu_s_per_1m_rows']:.2f}, push "
              f"{out['push_cpu_s_per_1m_rows']:.2f}")


if __name__ == "__main__":
    main()
