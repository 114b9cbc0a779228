"""etcd for a job on a Ray cluster: who serves each shard (``--coordinator``, docs/operations.md "Fencing").

Ray's own key-value store (the GCS) has no leases and no compare-and-set, so
it cannot say who serves a shard. A job on Ray gets an etcd one of two ways
(docs/ray.md):

- an etcd beside the cluster (a service every node reaches): pass its URL,
  ``start_servers(..., coordinator="etcd://HOST:2379", job="...")``;
- ``start_etcd()``: Debian's etcd (``make tools``, or the image's) in an
  actor on a node of the cluster, one member on the node's address; it ends
  with the actor, however that ends.

    with start_etcd() as etcd, start_servers(2, replicas=2, coordinator=etcd.url, job="j") as servers:
        ...
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import ray

from shardps.deploy.ray.placement import actor_logging


class EtcdActor:
    """One etcd member on this actor's node (its IP, free ports), its data in a temporary folder."""

    def __init__(self, timeout: float) -> None:
        from shardps.server.coordinator import LocalEtcd

        actor_logging()
        self.etcd = LocalEtcd(host=ray.util.get_node_ip_address(), with_parent=True).start(timeout)

    def url(self) -> str:
        return self.etcd.url

    def stop(self) -> None:
        self.etcd.close()


class EtcdService:
    """``start_etcd``'s etcd: its ``url`` (``etcd://IP:PORT``) and ``shutdown()`` (also a context manager)."""

    def __init__(self, actor: Any, url: str) -> None:
        self.actor, self.url = actor, url

    def shutdown(self, timeout: float = 30.0) -> None:
        try:
            ray.get(self.actor.stop.remote(), timeout=timeout)
        finally:
            ray.kill(self.actor, no_restart=True)

    def __enter__(self) -> EtcdService:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def start_etcd(*, resources: dict[str, float] | None = None, timeout: float = 60.0) -> EtcdService:
    """Start etcd in an actor (on a node with ``resources``, if given) and return once it answers, within
    ``timeout`` seconds. The node needs Debian's ``etcd`` binary: FileNotFoundError, from the actor, without
    it."""
    cls: Any = ray.remote(EtcdActor)
    actor = cls.options(num_cpus=0, resources=resources or {}).remote(timeout)
    try:
        url = ray.get(actor.url.remote(), timeout=timeout + 30.0)
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    return EtcdService(actor, url)
