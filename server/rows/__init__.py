"""Row tables on a shard (docs/sparse.md): the tables, one table's rows, the key index, the gRPC face, metrics,
resharding."""
