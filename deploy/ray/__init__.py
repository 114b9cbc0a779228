"""shardps on Ray: servers and workers as actors placed by placement groups, and ``shardps ray``.

Import it as ``shardps.ray`` (which says how to install Ray when it is
missing). See docs/ray.md.

The names below are imported on first use (PEP 562): each actor's process imports its own module of this
package (``stage_actor``, ``servers``, ...), and with it this file, and should not pay for all the others'
(about 0.3 CPU-s an actor here: docs/performance.md, "The test suite's time").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "STRATEGIES": "shardps.deploy.ray.placement",
    "EtcdService": "shardps.deploy.ray.etcd",
    "ExpertActors": "shardps.deploy.ray.experts",
    "OffloadStore": "shardps.deploy.ray.pipeline",
    "Pipeline": "shardps.deploy.ray.pipeline",
    "PipelineError": "shardps.deploy.ray.pipeline",
    "PlacementError": "shardps.deploy.ray.placement",
    "RayLocalCluster": "shardps.deploy.ray.local",
    "ServerGroup": "shardps.deploy.ray.servers",
    "WorkerContext": "shardps.deploy.ray.workers",
    "WorkerGroup": "shardps.deploy.ray.workers",
    "WorkersFailed": "shardps.deploy.ray.workers",
    "run_workers": "shardps.deploy.ray.workers",
    "start_etcd": "shardps.deploy.ray.etcd",
    "start_expert_actors": "shardps.deploy.ray.experts",
    "start_servers": "shardps.deploy.ray.servers",
}

__all__ = [
    "STRATEGIES",
    "EtcdService",
    "ExpertActors",
    "OffloadStore",
    "Pipeline",
    "PipelineError",
    "PlacementError",
    "RayLocalCluster",
    "ServerGroup",
    "WorkerContext",
    "WorkerGroup",
    "WorkersFailed",
    "run_workers",
    "start_etcd",
    "start_expert_actors",
    "start_servers",
]

if TYPE_CHECKING:
    from shardps.deploy.ray.etcd import EtcdService, start_etcd
    from shardps.deploy.ray.experts import ExpertActors, start_expert_actors
    from shardps.deploy.ray.local import RayLocalCluster
    from shardps.deploy.ray.pipeline import OffloadStore, Pipeline, PipelineError
    from shardps.deploy.ray.placement import STRATEGIES, PlacementError
    from shardps.deploy.ray.servers import ServerGroup, start_servers
    from shardps.deploy.ray.workers import WorkerContext, WorkerGroup, WorkersFailed, run_workers


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'shardps.deploy.ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
