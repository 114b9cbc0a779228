"""The wire contract shared by servers and workers.

Generated gRPC stubs (``shardps.protos.shardps.v1``), the tensor codec
(tensor <-> chunks of raw little-endian bytes), the shard map (tensor range
-> server) and the optimizer specs. Imports neither the server nor the worker.
"""
