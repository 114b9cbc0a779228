"""Tensor parallelism (Megatron-LM's column, row and vocabulary splits) inside a worker or a pipeline stage.

``split(model, plan, group)`` turns an ordinary model's ``nn.Linear`` / ``nn.Embedding`` into the parallel
layers from glob patterns over module names (``plan="auto"``: the plan a transformers model carries,
``plan_of``); ``gather`` returns the dense state dict; ``TPOptimizer`` makes a TP group's ranks
parameter-server workers of the dense tensors. ``group``: a ``TPGroup`` or a ``torch.distributed``
``ProcessGroup``. See docs/tensor-parallel.md and docs/your-model.md.
"""

from shardps.protos.slices import chunk_range
from shardps.worker.tp.group import Slice, TPGroup, open_tp_group
from shardps.worker.tp.hfplan import TRANSFORMERS_KINDS, plan_of
from shardps.worker.tp.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardps.worker.tp.loss import vocab_parallel_cross_entropy
from shardps.worker.tp.servers import TPOptimizer
from shardps.worker.tp.split import KINDS, clip_grad_norm_, gather, gather_grads, split, tp_slices

__all__ = [
    "KINDS", "TRANSFORMERS_KINDS", "ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RNGTracker",
    "RowParallelLinear", "Slice", "TPGroup", "TPOptimizer", "VocabParallelEmbedding", "chunk_range",
    "clip_grad_norm_", "gather", "gather_grads", "open_tp_group", "plan_of", "split", "tp_slices",
    "vocab_parallel_cross_entropy",
]
