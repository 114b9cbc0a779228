"""Server-side optimizer math, one module per optimizer.

``make_optimizer(spec)`` returns the implementation of a spec from
``shardps.protos.optim``. Implementations step one part of a tensor in place
(``param`` has the part's shape, see ``shardps.protos.shardmap.part_shape``)
and keep their state as a dict of tensors, so it can be counted and saved.
"""

from __future__ import annotations

from shardps.protos import optim as specs
from shardps.server.optim.adafactor import AdafactorImpl
from shardps.server.optim.adam import AdamImpl
from shardps.server.optim.base import PartInfo, Reduce, ServerOptimizer, local_reduce, state_bytes
from shardps.server.optim.sgd import SGDImpl
from shardps.server.optim.sm3 import SM3Impl

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


__all__ = ["PartInfo", "Reduce", "ServerOptimizer", "local_reduce", "make_optimizer", "state_bytes"]
