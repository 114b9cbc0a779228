"""Modules whose weights live on the parameter servers: ``shardps.nn.Embedding``, ``EmbeddingBag`` and ``MoE``.

Embedding tables held as rows on the servers (docs/sparse.md): a forward
pulls only the rows of the batch's ids, ``DistributedOptimizer.step()``
pushes their gradients, and a sparse optimizer (``shardps.optim.SparseAdam``,
``RowwiseAdagrad``, ``SGD``) updates only those rows on the servers. ``MoE``: a mixture-of-experts layer whose
experts are the rows of a row table (docs/moe.md).
"""

from shardps.worker.experts.moe import MoE
from shardps.worker.rows.modules import Embedding, EmbeddingBag

__all__ = ["Embedding", "EmbeddingBag", "MoE"]
