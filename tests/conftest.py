"""Shared fixtures: real gRPC servers on free loopback ports.

Tests that start servers get the ``cluster`` marker: those using the
fixtures below automatically, the others (processes, the demo, Ray) by hand.
``make test-fast`` runs the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FIXTURES = {"make_cluster", "cluster2", "ray_cluster"}


def on_ray_group(module: str) -> bool:
    """Whether a test module (its file name) runs in a Ray group: test_ray.py and every test_*_ray.py.
    The scheduler below sees node ids only, so the group is known by name; a module that uses the session's
    cluster under another name is refused at collection (pytest_collection_modifyitems)."""
    return module == "test_ray.py" or module.endswith("_ray.py")


# The Ray modules in two groups, each run by one xdist process with a session cluster of its own, so that no
# one process holds all of them: as one group they took 471-682 s of a 580-800 s suite, the longest of the
# three processes' shares (docs/history/performance-log.md, "The test suite's time").
RAY_GROUP_B = {"test_pipeline_ray.py", "test_moe_ray.py"}


def ray_group(module: str) -> str | None:
    """The xdist group of a Ray module (its file name): "ray-a" or "ray-b"; None for the other modules."""
    if not on_ray_group(module):
        return None
    return "ray-b" if module in RAY_GROUP_B else "ray-a"


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run with -p no:xdist does not know it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadgroup`` with the Ray tests in their two groups (ray_group). xdist (3.8) groups by a
    suffix it appends to each marked item's ``_nodeid``, which pytest 9 no longer reads (a node's id is
    ``_id``): the marks were ignored and each Ray module went to whichever process was free, a session
    cluster starting for each. This scheduler groups by module name instead, here in the controller, which
    collects nothing; every other module is a unit of its own, as loadgroup makes it."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # xdist hands out units by how many tests each holds (its option ``loadscopereorder``, on by default), which put the
    # Ray groups, the partition harness and the long modules in the middle of the run and its tail
    # (pytest_collection_modifyitems orders them first): the units go in collection order instead.
    config.option.loadscopereorder = False

    class RayGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return ray_group(module.rsplit("/", 1)[-1]) or module

    return RayGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
    # The tests on the session's Ray cluster come first, each group's one after the other in one xdist process
    # (`make test` runs the suite in three, --dist loadgroup): that process starts its cluster at once and
    # stops it after the group's last test (pytest_runtest_teardown), then takes other modules. Two Ray
    # clusters starting at once on 2 cores were seen to time out ("node timed out during startup"), so starts
    # take tests/raystart.py's lock; running side by side they do not. Their order among themselves, and
    # everyone else's, is kept.
    on_ray = [i for i in items if "ray_cluster" in getattr(i, "fixturenames", ())]
    misnamed = sorted({i.path.name for i in on_ray if not on_ray_group(i.path.name)})
    if misnamed:
        raise pytest.UsageError(f"{', '.join(misnamed)} use the session's Ray cluster (ray_cluster) but are not "
                                "named test_*_ray.py: under `make test` they would run outside the Ray groups")
    for item in items:  # every test of a Ray module (all of on_ray, by the check above) in its module's group
        group = ray_group(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    # Then the partition harness's group (one process, about two minutes of mostly waiting) and the other long
    # modules, longest first, so that no process starts one of them last; the many short ones fill in after.
    rank = {name: k for k, name in enumerate(LONG_MODULES)}
    rest = [i for i in items if "ray_cluster" not in getattr(i, "fixturenames", ())]
    items[:] = on_ray + sorted(rest, key=lambda i: rank.get(i.path.name, len(rank)))  # stable: order kept within


# Modules of the longest wall time under `make test` (seconds in a run of 616 s, 2026-12-07 21:47 UTC, three
# processes on 2 cores): the partition harness 96, test_demo 69, test_replication_kill 66, test_ray_own_cluster
# 64, test_fuzz 62, test_partitions 59, test_deploy 41, test_netsim 38, test_spawn 36; with xdist's own order
# (units with the most tests first) test_ray_own_cluster started at 539 s and ended the run at 616.
LONG_MODULES = ("test_partition_harness.py", "test_demo.py", "test_replication_kill.py", "test_ray_own_cluster.py",
                "test_fuzz.py", "test_partitions.py", "test_deploy.py", "test_netsim.py", "test_spawn.py",
                "test_cli.py", "test_recovery.py", "test_fencing.py")


class SessionRay:
    """The session's Ray cluster: a head (4 CPUs) and a second node (4 CPUs, resources ps and offload),
    started with ``ray start`` on free ports, token auth on; this process is its driver. Started on first
    use, stopped (exactly its own processes) after the last test that uses it, so that it does not idle
    (about 0.15 CPU) under the tests that do not; a later use would start it again. Attributes are the
    running ``RayLocalCluster``'s."""

    def __init__(self) -> None:
        self._rc: object | None = None

    def running(self) -> object:
        if self._rc is None:
            import ray

            from shardps.deploy.ray.local import RayLocalCluster
            from tests.raystart import ray_start_lock

            # Actors import tests.* (training loops) from the repository: every node runs on this machine,
            # so its path will do, in the nodes' own environment. (Not a working_dir: jobs the tests submit
            # upload the same content, and Ray deleted the shared unpacked copy under a running job. Not the
            # driver's runtime_env: each actor's worker would start through Ray's setup_worker.py; the Ray
            # group took 396-501 CPU seconds that way, 342-347 this way: docs/history/performance-log.md.)
            with ray_start_lock():
                rc = RayLocalCluster(num_cpus=4, node_env={"PYTHONPATH": str(ROOT)}, log_monitor=False).start()
            try:
                with ray_start_lock():
                    rc.add_node(num_cpus=4, resources={"ps": 1, "offload": 1})
                rc.wait_for_jobs()
                ray.init(address=rc.address, log_to_driver=False)
            except BaseException:
                rc.stop()
                raise
            self._rc = rc
        return self._rc

    def __getattr__(self, name: str) -> object:
        # Only the cluster's public attributes start it: pytest probes every object a conftest holds for
        # private ones (`_mock_name`, `__wrapped__`) when it collects, which would start a cluster in every
        # pytest process, xdist workers and runs without a Ray test included, and leave it running.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.running(), name)

    def stop(self) -> None:
        rc, self._rc = self._rc, None
        if rc is not None:
            import ray

            try:
                ray.shutdown()
            finally:
                rc.stop()  # type: ignore[attr-defined]


SESSION_RAY = SessionRay()


@pytest.fixture(scope="session")
def ray_session() -> Iterator[SessionRay]:
    try:
        yield SESSION_RAY
    finally:
        SESSION_RAY.stop()


@pytest.fixture
def ray_cluster(ray_session: SessionRay) -> SessionRay:
    """The session's Ray cluster (``SessionRay``), running when the test starts: started again if the end
    of an earlier test stopped it (pytest_runtest_teardown)."""
    ray_session.running()
    return ray_session


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "ray_cluster" in getattr(item, "fixturenames", ()) and (
            nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ())):
        SESSION_RAY.stop()
