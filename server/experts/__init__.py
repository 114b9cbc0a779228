"""Experts run where they live (shardps.nn.MoE's "send" placement): the gRPC face and the gradients held between
backwards."""
