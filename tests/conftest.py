"""Shared fixtures: real gRPC servers on free loopback ports.

Tests that start servers get the ``cluster`` marker: those using the
fixtures below automatically, the others (processes, the demo, Ray) by hand.
``make test-fast`` runs the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import shardps


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., shardps.LocalCluster]]:
    """Start in-process LocalClusters; all are stopped at the end of the test."""
    started: list[shardps.LocalCluster] = []

    def make(num_servers: int = 2, **kw: object) -> shardps.LocalCluster:
        c = shardps.LocalCluster(num_servers, **kw).start()  # type: ignore[arg-type]
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


@pytest.fixture
def cluster2(make_cluster: Callable[..., shardps.LocalCluster]) -> shardps.LocalCluster:
    return make_cluster(2)


CLUSTER_FIXTURES = {"make_cluster", "cluster2"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
