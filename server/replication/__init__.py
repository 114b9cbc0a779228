"""Primary-backup replication of a shard (--replicas 2): the replica side's state machine, its gRPC transport,
the snapshot codec, the interfaces to other servers, the roles."""
