"""The operator's commands: ``shardps ctl ...`` (set-sync, checkpoint, promote, attach-replica),
``shardps stats`` and ``shardps health``.

The calls themselves (``stats``, ``set_sync``, ``checkpoint``, ``promote``,
``attach_replica``, ``health``) live in ``worker/operator.py`` and are
importable from here as before (``shardps.admin.stats`` ...). The ``run_*``
functions are the commands: they connect, call and print. ``stats_rows``
turns the shards' Stats into table rows (``row_table_rows``: a second table,
one line per row table and shard, where there are row tables);
``render_table`` formats them for a terminal. Staleness percentiles come
from the shards' exact staleness counts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from shardps.protos.security import Security
from shardps.worker.client import connect
from shardps.worker.datapath.reach import run_health
from shardps.worker.operator import attach_replica, checkpoint, health, promote, set_sync, stats

__all__ = [
    "COLUMNS", "attach_replica", "checkpoint", "health", "percentile", "promote", "render_table", "run_attach_replica",
    "ROW_COLUMNS", "row_table_rows", "run_checkpoint", "run_health", "run_promote", "run_set_sync", "run_stats",
    "set_sync", "stats", "stats_rows",
]

# -- the commands ---------------------------------------------------------------

COLUMNS = ("shard", "version", "sync", "tensors", "weights MiB", "opt state MiB", "stale p50", "stale p99",
           "clock gap", "live workers", "pushes", "skipped", "replica")

ROW_COLUMNS = ("shard", "row table", "dim", "optimizer", "rows", "MiB", "steps", "stale p50", "stale p99",
               "admitted", "dropped", "expired", "skipped")


def percentile(counts: dict[int, int], q: float) -> int | None:
    """The smallest staleness s with at least a fraction q of gradients at or below it."""
    total = sum(counts.values())
    if not total:
        return None
    seen = 0
    for s in sorted(counts):
        seen += counts[s]
        if seen >= q * total:
            return s
    return max(counts)


def stats_rows(stats: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in stats:
        clocks = {w: s["worker_clocks"].get(w, -1) + 1 for w in range(s["num_workers"])}
        gap = max(clocks.values()) - min(clocks.values()) if clocks else 0
        p50, p99 = percentile(s["staleness_counts"], 0.5), percentile(s["staleness_counts"], 0.99)
        rows.append([
            str(s["shard_index"]), str(s["version"]), s["sync"] or "-", str(len(s["tensors"])),
            f"{sum(t['weight_bytes'] for t in s['tensors']) / 2**20:.2f}",
            f"{sum(t['optimizer_state_bytes'] for t in s['tensors']) / 2**20:.2f}",
            "-" if p50 is None else str(p50), "-" if p99 is None else str(p99), str(gap),
            f"{len(s['registered_workers'])}/{s['num_workers']}", str(s["pushes_total"]),
            str(s["skipped_steps_total"]), s.get("replica_state") or "none",
        ])
    return rows


def row_table_rows(stats: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One line per (shard, row table): its rows, bytes (rows, optimizer state and index), steps, row
    staleness percentiles and counts."""
    rows = []
    for s in stats:
        for t in s.get("row_tables", ()):
            p50, p99 = percentile(t["staleness_counts"], 0.5), percentile(t["staleness_counts"], 0.99)
            mib = (t["weight_bytes"] + t["state_bytes"] + t["index_bytes"]) / 2**20
            rows.append([str(s["shard_index"]), t["name"], str(t["dim"]), t["optimizer"], str(t["rows"]),
                         f"{mib:.2f}", str(t["steps"]), "-" if p50 is None else str(p50),
                         "-" if p99 is None else str(p99), str(t["admitted"]), str(t["dropped"]),
                         str(t["expired"]), str(t["skipped"])])
    return rows


def render_table(rows: list[list[str]], columns: Sequence[str] = COLUMNS) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def run_stats(addresses: list[str], *, watch: float | None = None, timeout: float = 10.0,
              out: TextIO = sys.stdout, iterations: int | None = None, security: Security | None = None) -> int:
    """Print the shards' table once, or every ``watch`` seconds until Ctrl-C (or ``iterations``)."""
    with connect(addresses, timeout=timeout, ready_timeout=timeout, security=security) as client:
        n = 0
        try:
            while True:
                got = stats(client.transport)
                table = render_table(stats_rows(got))
                if row_table_rows(got):
                    table += "\n\n" + render_table(row_table_rows(got), ROW_COLUMNS)
                if watch:
                    out.write("\x1b[2J\x1b[H" if out.isatty() else "")
                    out.write(f"shardps stats  {time.strftime('%H:%M:%S')}  every {watch:g}s (Ctrl-C to stop)\n")
                out.write(table + "\n")
                out.flush()
                n += 1
                if not watch or (iterations is not None and n >= iterations):
                    return 0
                time.sleep(watch)  # the refresh interval of the display
        except KeyboardInterrupt:
            return 0


def run_set_sync(addresses: list[str], sync: str, *, timeout: float = 30.0, out: TextIO = sys.stdout,
                 security: Security | None = None) -> int:
    with connect(addresses, timeout=timeout, ready_timeout=timeout, security=security) as client:
        modes = set_sync(client.transport, sync)
    out.write(f"sync is now {modes[0]} on {len(modes)} shards; workers follow from their next step\n")
    return 0


def run_checkpoint(addresses: list[str], *, timeout: float = 60.0, out: TextIO = sys.stdout,
                   security: Security | None = None) -> int:
    with connect(addresses, timeout=timeout, ready_timeout=timeout, security=security) as client:
        written = checkpoint(client.transport)
    for shard, (version, path) in enumerate(written):
        out.write(f"shard {shard}: checkpoint at version {version}: {path}\n")
    return 0


def run_promote(addresses: list[str], *, force: bool = False, timeout: float = 30.0, out: TextIO = sys.stdout,
                security: Security | None = None) -> int:
    """Make the backups at ``addresses`` (servers' replica ports) serve their shards."""
    for address in addresses:
        r = promote(address, force=force, timeout=timeout, security=security)
        out.write(f"{address}: serves shard {r.shard_index} from version {r.version}\n")
    return 0


def run_attach_replica(addresses: list[str], shard: int, target: str, *, timeout: float = 30.0,
                       out: TextIO = sys.stdout, security: Security | None = None) -> int:
    """Give shard ``shard`` (at ``addresses[shard]``) a backup at ``target``; wait for it to sync."""
    if not 0 <= shard < len(addresses):
        raise ValueError(f"--shard must be in [0, {len(addresses)}), got {shard}")
    r = attach_replica(addresses[shard], target, timeout=timeout, security=security)
    out.write(f"shard {shard}: backup at {target} is {r.replica_state}\n")
    return 0 if r.replica_state == "synced" else 1
