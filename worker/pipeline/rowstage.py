"""Row modules in pipeline stages (``shardps.nn.Embedding``, ``EmbeddingBag``, ``MoE``): what a pipeline
must be for them, checked before any actor starts (docs/moe.md, "In a pipeline stage").

A stage's row modules live on the servers: the stage actor attaches them to its client and pushes their
tables as its replica (worker id ``replica`` of ``replicas``: a table is held by one stage of each replica),
at the step's end, with the dense gradients (deploy/ray/stage_actor.py). So they need:

- ``servers``: their rows are nowhere else;
- a barrier sync mode (bsp, every:X): under asp/ssp the stage's push runs in the background while the next
  step's forwards pull rows of their own, and the rows pulled must be pushed by the step that pulled them;
- neither ``stream`` nor ``tensor_parallel`` (their steppers do not push row tables).

An ``MoE`` under "send" runs with any ``chunks``: each micro-batch's backward holds the experts' gradients on
the shards and the step's push has them pushed (``ExpertRows.hold``, set by the stage actor); under "auto" every
micro-batch of a step takes the placement of the step's first (``MoE.choose``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from shardps.protos.syncspec import SyncSpec
from shardps.worker.moe import MoE
from shardps.worker.rowmodules import _Rows


def check_row_modules(stages: Sequence[nn.Module], *, servers: object, sync: SyncSpec, stream: object,
                      tensor_parallel: int) -> None:
    """Raise ``ValueError`` naming the module and the option when a stage's row modules cannot run."""
    for i, stage in enumerate(stages):
        found = [(path, m) for path, m in stage.named_modules() if isinstance(m, (_Rows, MoE))]
        if not found:
            continue
        path, m = found[0]
        what = f"stage {i}'s {type(m).__name__} {path!r} (its rows live on the servers)"
        if not servers:
            raise ValueError(f"{what} needs servers=")
        if not sync.barrier:
            raise ValueError(f"{what} needs a barrier sync mode (bsp or every:X), got {sync}")
        if stream is not None or tensor_parallel > 1:
            raise ValueError(f"{what} does not run with {'stream=' if stream is not None else 'tensor_parallel'}")

