"""Gradient compression for ``DistributedOptimizer(compress=...)``: ``TopK(0.01)``, ``PowerSGD(rank=4)``.

Both run with error feedback (the part not sent is kept and added to the
next gradient) and an optional dense warm-up (``warmup_steps``). A plain
spec compresses every tensor of rank >= 2 and at least ``DENSE_BELOW``
elements; ``Rules`` choose per tensor (``Dense()`` for none)::

    compress=Rules([("embed.*", Dense()), ("*.bias", TopK(0.1))], default=TopK(0.01, warmup_steps=100))

Shards decode and aggregate; pulls stay dense. See docs/compression.md.
"""

from shardps.cliargs import compress_flags
from shardps.protos.rules import Rules, max_rank, min_rank
from shardps.worker.compress import DENSE_BELOW, CompressChoice, Compressor, Dense, PowerSGD, Spec, TopK, parse

__all__ = ["DENSE_BELOW", "CompressChoice", "Compressor", "Dense", "PowerSGD", "Rules", "Spec", "TopK",
           "compress_flags", "max_rank", "min_rank", "parse"]
