"""shardps: sharded gRPC parameter servers for PyTorch training.

    import shardps
    with shardps.LocalCluster(num_servers=2) as cluster:
        client = shardps.connect(cluster.addresses, worker_id=0, num_workers=1)
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-3), sync="bsp")
        ...
"""

from shardps import compress, optim
from shardps.deploy.local import LocalCluster
from shardps.protos.amp import LossScaling
from shardps.worker.client import PSClient, PushResult, connect
from shardps.worker.errors import RolledBack, ShardError
from shardps.worker.optimizer import DistributedOptimizer

__version__ = "0.1.0"

__all__ = [
    "DistributedOptimizer",
    "LocalCluster",
    "LossScaling",
    "PSClient",
    "PushResult",
    "RolledBack",
    "ShardError",
    "compress",
    "connect",
    "optim",
]
