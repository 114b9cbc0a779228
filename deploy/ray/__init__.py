"""shardps on Ray: servers and workers as actors placed by placement groups, and ``shardps ray``.

Import it as ``shardps.ray`` (which says how to install Ray when it is
missing). See docs/ray.md.
"""

from shardps.deploy.ray.etcd import EtcdService, start_etcd
from shardps.deploy.ray.experts import ExpertActors, start_expert_actors
from shardps.deploy.ray.local import RayLocalCluster
from shardps.deploy.ray.pipeline import OffloadStore, Pipeline, PipelineError
from shardps.deploy.ray.placement import STRATEGIES, PlacementError
from shardps.deploy.ray.servers import ServerGroup, start_servers
from shardps.deploy.ray.workers import WorkerContext, WorkerGroup, WorkersFailed, run_workers

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
