"""The order `make test` hands its units out in (tests/conftest.py): the Ray groups, then the long modules, then
the rest, as collected. xdist's own default (its option ``loadscopereorder``: the units with the most tests first) put
the longest units in the middle and the tail of the run (docs/performance.md, "The test suite's time")."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from tests import conftest


class _Log:
    def __getattr__(self, name: str) -> _Log:
        return self

    def __call__(self, *args: object) -> None:
        pass


class _Config:
    def __init__(self) -> None:
        self.option = argparse.Namespace(loadscopereorder=True, dist="loadgroup", tx=["popen", "popen"])

    def getvalue(self, name: str) -> object:
        return getattr(self.option, name)


class _Node:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        pass


def test_units_go_out_in_collection_order_grouped_by_ray_group_and_module():
    config = _Config()
    sched = conftest.pytest_xdist_make_scheduler(config, _Log())
    assert config.option.loadscopereorder is False
    # As pytest_collection_modifyitems orders them: the Ray groups first, a long module, then a module with the
    # most tests (which xdist's own order would hand out first).
    collection = ["tests/test_ray.py::a", "tests/test_tp_ray.py::b", "tests/test_pipeline_ray.py::c",
                  "tests/test_demo.py::d", "tests/server/test_adafactor.py::e1", "tests/server/test_adafactor.py::e2",
                  "tests/server/test_adafactor.py::e3", "tests/server/test_adafactor.py::e4"]
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    first = [[collection[i] for i in node.sent] for node in nodes]
    # Each node starts with two units (xdist's rule); the first units are the Ray groups, in order.
    assert first[0][:2] == ["tests/test_ray.py::a", "tests/test_tp_ray.py::b"]  # ray-a: one unit
    assert first[1][0] == "tests/test_pipeline_ray.py::c"  # ray-b
    assert "tests/server/test_adafactor.py::e1" not in first[0][:2] + first[1][:1]


def test_the_ray_modules_come_first_then_the_long_modules_longest_first():
    def item(name: str, fixtures: tuple[str, ...] = ()) -> SimpleNamespace:
        marks: list[object] = []
        return SimpleNamespace(path=SimpleNamespace(name=name), fixturenames=fixtures, add_marker=marks.append,
                               marks=marks)

    items = [item("test_a.py"), item("test_spawn.py"), item("test_ray.py", ("ray_cluster",)), item("test_b.py"),
             item("test_partition_harness.py"), item("test_ray.py"), item("test_demo.py")]
    conftest.pytest_collection_modifyitems(SimpleNamespace(), items)  # type: ignore[arg-type]
    assert [i.path.name for i in items] == ["test_ray.py", "test_partition_harness.py", "test_demo.py",
                                            "test_spawn.py", "test_a.py", "test_b.py", "test_ray.py"]
