"""shardps: sharded gRPC parameter servers for PyTorch training.

    import shardps
    with shardps.LocalCluster(num_servers=2) as cluster:
        client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-3), sync="bsp")
        ...

The names below are imported on first use (PEP 562), so that a process that needs none of them (``shardps
health``, a container's healthcheck every few seconds) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "DistributedOptimizer": "shardps.worker.optimizer",
    "LocalCluster": "shardps.deploy.local",
    "LossScaling": "shardps.protos.amp",
    "PSClient": "shardps.worker.client",
    "PushResult": "shardps.worker.client",
    "RolledBack": "shardps.worker.errors",
    "ShardError": "shardps.worker.errors",
    "Stream": "shardps.worker.streaming.plan",
    "connect": "shardps.worker.client",
}
_SUBMODULES = ("compress", "nn", "optim")

__all__ = [
    "DistributedOptimizer",
    "LocalCluster",
    "LossScaling",
    "PSClient",
    "PushResult",
    "RolledBack",
    "ShardError",
    "Stream",
    "compress",
    "connect",
    "nn",
    "optim",
]

if TYPE_CHECKING:
    from shardps import compress, nn, optim
    from shardps.deploy.local import LocalCluster
    from shardps.protos.amp import LossScaling
    from shardps.worker.client import PSClient, PushResult, connect
    from shardps.worker.errors import RolledBack, ShardError
    from shardps.worker.optimizer import DistributedOptimizer
    from shardps.worker.streaming.plan import Stream


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:  # a subpackage (shardps.deploy, shardps.worker, ...), as an eager import would have left it
        try:
            value = importlib.import_module(f"shardps.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"shardps.{name}":
                raise
            raise AttributeError(f"module 'shardps' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE, *_SUBMODULES])
