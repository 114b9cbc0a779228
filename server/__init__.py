"""The parameter-server side: ShardStore (state), sync policies, optimizers, gRPC service."""
