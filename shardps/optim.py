"""Optimizer specs for the servers: ``shardps.optim.Adam(lr=1e-3)`` and friends.

Hyperparameter names and defaults follow ``torch.optim`` (Adafactor: HF
``transformers.Adafactor``; SM3: google-research ``sm3``); ``SparseAdam``,
``RowwiseAdagrad`` and plain ``SGD`` step row tables (docs/sparse.md); the step runs on
the parameter servers. ``Rules`` picks an optimizer per tensor by name
pattern or rank.
"""

from shardps.protos.optim import (
    SGD,
    SM3,
    Adafactor,
    Adam,
    AdamW,
    OptimizerSpec,
    RowwiseAdagrad,
    SparseAdam,
    spec_from_name,
)
from shardps.protos.rules import Rules, max_rank, min_rank

__all__ = ["SGD", "SM3", "Adafactor", "Adam", "AdamW", "OptimizerSpec", "RowwiseAdagrad", "Rules", "SparseAdam",
           "max_rank", "min_rank", "spec_from_name"]
