"""Optimizer specs for the servers: ``shardps.optim.Adam(lr=1e-3)`` and friends.

Hyperparameter names and defaults follow ``torch.optim``; the step runs on
the parameter servers.
"""

from shardps.protos.optim import SGD, Adam, AdamW, OptimizerSpec, spec_from_name

__all__ = ["SGD", "Adam", "AdamW", "OptimizerSpec", "spec_from_name"]
