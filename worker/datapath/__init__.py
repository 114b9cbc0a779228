"""How a worker's tensor bytes reach the shards: the transport (channels, retries, fail-over), each shard's path
(data connection, shared memory, gRPC), push and pull."""
