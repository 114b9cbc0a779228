"""Server-side optimizer math, one module per optimizer.

``make_optimizer(spec)`` returns the implementation of a spec from
``shardps.protos.optim``. Implementations step one part of a tensor in place
(``param`` has the part's shape, see ``shardps.protos.shardmap.part_shape``)
and keep their state as a dict of tensors, so it can be counted and saved.
``make_row_optimizer(spec)``: a row table's (server/optim/rowbase.py).
"""

from __future__ import annotations

from shardps.protos import optim as specs
from shardps.server.optim.adafactor import AdafactorImpl
from shardps.server.optim.adam import AdamImpl
from shardps.server.optim.base import PartInfo, Reduce, ServerOptimizer, local_reduce, state_bytes
from shardps.server.optim.row_sm3 import RowSM3Impl
from shardps.server.optim.rowbase import RowOptimizer, RowSGD, RowState
from shardps.server.optim.rowwise_adagrad import RowwiseAdagradImpl
from shardps.server.optim.sgd import SGDImpl
from shardps.server.optim.sm3 import SM3Impl
from shardps.server.optim.sparse_adam import SparseAdamImpl

_IMPLS: dict[type[specs.OptimizerSpec], type[ServerOptimizer]] = {
    specs.Adam: AdamImpl,
    specs.AdamW: AdamImpl,
    specs.SGD: SGDImpl,
    specs.Adafactor: AdafactorImpl,
    specs.SM3: SM3Impl,
}


def make_optimizer(spec: specs.OptimizerSpec) -> ServerOptimizer:
    try:
        impl = _IMPLS[type(spec)]
    except KeyError:
        raise ValueError(f"no server implementation for optimizer {spec.name!r}") from None
    return impl(spec)


_ROW_IMPLS: dict[type[specs.OptimizerSpec], type[RowOptimizer]] = {
    specs.SparseAdam: SparseAdamImpl,
    specs.RowwiseAdagrad: RowwiseAdagradImpl,
    specs.SGD: RowSGD,
    specs.SM3: RowSM3Impl,
}


def make_row_optimizer(spec: specs.OptimizerSpec) -> RowOptimizer:
    """A row table's optimizer (server/optim/rowbase.py); ValueError for one that does not step rows."""
    specs.check_row_optimizer(spec)
    return _ROW_IMPLS[type(spec)](spec)


__all__ = ["PartInfo", "Reduce", "RowOptimizer", "RowState", "ServerOptimizer", "local_reduce", "make_optimizer",
           "make_row_optimizer", "state_bytes"]
