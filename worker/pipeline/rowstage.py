"""Row modules in pipeline stages (``shardps.nn.Embedding``, ``EmbeddingBag``, ``MoE``): what a pipeline
must be for them, checked before any actor starts (docs/moe.md, "In a pipeline stage").

A stage's row modules live on the servers: the stage actor attaches them to its client and pushes their
tables as its replica (worker id ``replica`` of ``replicas``: a table is held by one stage of each replica),
at the step's end, with the dense gradients (deploy/ray/stage_actor.py). So they need:

- ``servers``: their rows are nowhere else;
- under asp/ssp, the step's push and pull in the step (``StageWeights(overlap=False)``), not in the
  background beside the next step's forwards: those pull rows of their own, and the rows a step pulled must
  be pushed by it; the servers still apply each replica's push on arrival (the tables' sync follows the
  job's: asp rows under asp and ssp);
- neither ``stream`` nor ``tensor_parallel`` (their steppers do not push row tables).

An ``MoE`` under "send" runs with any ``chunks``: each micro-batch's backward holds the experts' gradients on
the shards and the step's push has them pushed (``ExpertRows.hold``, set by the stage actor); under "auto" every
micro-batch of a step takes the placement of the step's first (``MoE.choose``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from shardps.worker.experts.moe import MoE
from shardps.worker.rows.modules import _Rows


def has_row_modules(module: nn.Module) -> bool:
    """Whether ``module`` holds a row module (its stage then syncs in the step under asp/ssp too)."""
    return any(isinstance(m, (_Rows, MoE)) for m in module.modules())


def check_row_modules(stages: Sequence[nn.Module], *, servers: object, stream: object, tensor_parallel: int) -> None:
    """Raise ``ValueError`` naming the module and the option when a stage's row modules cannot run."""
    for i, stage in enumerate(stages):
        found = [(path, m) for path, m in stage.named_modules() if isinstance(m, (_Rows, MoE))]
        if not found:
            continue
        path, m = found[0]
        what = f"stage {i}'s {type(m).__name__} {path!r} (its rows live on the servers)"
        if not servers:
            raise ValueError(f"{what} needs servers=")
        if stream is not None or tensor_parallel > 1:
            raise ValueError(f"{what} does not run with {'stream=' if stream is not None else 'tensor_parallel'}")

