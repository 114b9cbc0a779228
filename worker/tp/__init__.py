"""Tensor parallelism inside a worker or a pipeline stage (Megatron-LM's splits); see docs/tensor-parallel.md.
``shardps.tp`` is the public face."""
