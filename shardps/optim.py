"""Optimizer specs for the servers: ``shardps.optim.Adam(lr=1e-3)`` and friends.

Hyperparameter names and defaults follow ``torch.optim`` (Adafactor: HF
``transformers.Adafactor``; SM3: google-research ``sm3``); the step runs on
the parameter servers.
"""

from shardps.protos.optim import SGD, SM3, Adafactor, Adam, AdamW, OptimizerSpec, spec_from_name

__all__ = ["SGD", "SM3", "Adafactor", "Adam", "AdamW", "OptimizerSpec", "spec_from_name"]
