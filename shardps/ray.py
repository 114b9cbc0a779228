"""``shardps.ray``: parameter servers and workers as Ray actors (needs ``pip install 'shardps[ray]'``).

``import shardps`` does not import Ray; this module does, and says how to
install it when it is missing. See docs/ray.md and ``shardps.deploy.ray``.
"""

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by tests/test_ray.py in a subprocess
    raise ImportError("shardps.ray needs Ray: pip install 'shardps[ray]'") from e

from shardps.deploy.ray import (  # noqa: E402
    STRATEGIES,
    EtcdService,
    ExpertActors,
    OffloadStore,
    Pipeline,
    PipelineError,
    PlacementError,
    RayLocalCluster,
    ServerGroup,
    WorkerContext,
    WorkerGroup,
    WorkersFailed,
    run_workers,
    start_etcd,
    start_expert_actors,
    start_servers,
)

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
