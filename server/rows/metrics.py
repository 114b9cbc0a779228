"""Prometheus metrics of a shard's row tables (docs/sparse.md), read at scrape time.

Labels ``shard`` and ``table``; the values are ``RowTables.stats()``
(server/rows/tables.py), exact counts the tables keep, so nothing is recorded per
request. ``StoreCollector`` (server/metrics.py) yields them for the shards
it serves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shardps.server.rows.tables import RowTables

#: (metric, kind, help, key of RowTables.stats())
FAMILIES = (
    ("shardps_row_table_rows", "gauge", "Rows of the table this shard holds.", "rows"),
    ("shardps_row_table_bytes", "gauge", "Bytes of the table's rows and optimizer state held here.", "bytes"),
    ("shardps_row_table_steps", "counter", "Optimizer steps of the table on this shard (one per push or bsp step).",
     "steps"),
    ("shardps_row_admitted", "counter", "Rows created by admission (their key's admit-th push).", "admitted"),
    ("shardps_row_dropped_gradients", "counter", "Gradient rows dropped: their key was not admitted yet.",
     "dropped"),
    ("shardps_row_expired", "counter", "Rows dropped by expiry (not pushed for expire steps).", "expired"),
    ("shardps_row_duplicate_pushes", "counter", "Retried row pushes answered without applying.", "duplicates"),
    ("shardps_row_pending_admission", "gauge", "Keys seen but not admitted yet.", "pending_admission"),
    ("shardps_row_skipped_steps", "counter", "Steps of the table skipped: an inf/nan in some gradient of them.",
     "skipped"),
)


def row_families(shards: Sequence[tuple[str, RowTables]]) -> Iterator[Metric]:
    """One family per FAMILIES entry over the (shard label, tables) given."""
    stats = [(shard, rows.stats()) for shard, rows in shards]
    for name, kind, doc, key in FAMILIES:
        m = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["shard", "table"])
        for shard, tables in stats:
            for table, st in sorted(tables.items()):
                value = st["weight_bytes"] + st["state_bytes"] if key == "bytes" else st[key]
                m.add_metric([shard, table], float(value))
        yield m
