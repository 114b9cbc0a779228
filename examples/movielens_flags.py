"""The movielens example's settings (examples/movielens.py), apart so that ``shardps``'s parser names their
defaults without importing torch."""

from __future__ import annotations

DEFAULTS = {"dim": 8, "epochs": 5, "batch": 1000, "lr": 0.005, "servers": 2}  # run()'s settings, as given here
