"""The MoE example's flags (examples/moe_gpt.py), apart so that ``shardps``'s parser adds them without torch."""

from __future__ import annotations

import argparse

# The model's size and length, flags the demo's gpt example has too (``shardps demo``: their defaults there
# are per example, applied when the example is chosen).
MODEL_DEFAULTS = {"steps": 200, "dim": 64, "layers": 2, "context": 64}


def add_flags(p: argparse._ActionsContainer, model: bool = True) -> None:
    """The MoE example's own flags (also on ``shardps demo --example moe``); ``model=False`` leaves out
    the model's size and length (``MODEL_DEFAULTS``), which the demo adds for all its examples."""
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer; 0: the dense model (default 8)")
    p.add_argument("--top-k", type=int, default=1, help="experts per token (default 1: Switch)")
    p.add_argument("--placement", choices=("pull", "send", "auto"), default="pull",
                   help="pull the routed experts, send the tokens to them, or choose per step (default pull)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="MoE capacity factor (default 1.25)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between validation losses (default 50)")
    if model:
        p.add_argument("--steps", type=int, default=200, help="training steps of the MoE example (default 200)")
        p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
        p.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
        p.add_argument("--context", type=int, default=64, help="characters per sequence (default 64)")
