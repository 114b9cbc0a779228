"""The whole house's layers: arrows only point down, and no module is part of an import circle.

Every import counts: at the top of a module, inside a function (lazy), and
under ``TYPE_CHECKING``. The packages as installed::

    shardps (the face: CLI, public API)   may import everything below
    shardps.deploy                        may import worker, server, protos
    shardps.worker | shardps.server       may import protos, never each other
    shardps.protos                        imports none of the above

(shardps.testing, what the tests and the benchmarks share, sits beside the
face too, and nothing else of the package imports it. shardps.examples sits
beside the face and may import all of it, and so do the commands that run the examples, ``shardps.deploy.demo``,
``shardps.deploy.demo_examples`` and ``shardps.deploy.ray.job``: they are
the face's commands, kept beside what they start.) The face's
``shardps.exposition`` (serving a Prometheus registry over HTTP) is imported
by the server, the worker and deploy alike: the one arrow that points up
today, allowed here by name until it has a home of its own below the face.
tests/server/test_layering.py checks the store and its parts more closely.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"shardps": "shardps", "shardps.server": "server", "shardps.worker": "worker",
            "shardps.protos": "protos", "shardps.deploy": "deploy", "shardps.examples": "examples",
            "shardps.testing": "shardps/testing"}
LAYER = {"shardps": 3, "shardps.examples": 3, "shardps.testing": 3, "shardps.deploy": 2, "shardps.worker": 1,
         "shardps.server": 1, "shardps.protos": 0}
UPWARD_ALLOWED = {"shardps.exposition"}
# Run the examples: the face's layer.
COMMANDS = {"shardps.deploy.demo", "shardps.deploy.demo_examples", "shardps.deploy.ray.job"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, d in PACKAGES.items():
        for f in sorted((ROOT / d).rglob("*.py")):
            if "_pb2" in f.name:  # generated stubs import only protobuf and grpc
                continue
            parts = [p for p in f.relative_to(ROOT / d).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that ``name`` (a module or a name in one) is, or None for another package's."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for n in names:
            if n.startswith("shardps"):
                target = _resolve(n)
                if target is not None and target != module:
                    out.add(target)
    # "from shardps.x import y" names a module y or a name in x: keep the deepest module each import names
    return {m for m in out if not any(o != m and o.startswith(m + ".") for o in out) or m in MODULES}


GRAPH = {m: _imports(m) for m in MODULES}


def _package(module: str) -> str:
    for pkg in sorted(PACKAGES, key=len, reverse=True):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    raise AssertionError(module)


def _face(module: str) -> bool:
    return _package(module) == "shardps"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _face(m)
                                           and _package(m) not in ("shardps.examples", "shardps.testing")))
def test_arrows_point_down(module):
    pkg = _package(module)
    layer = LAYER["shardps"] if module in COMMANDS else LAYER[pkg]
    bad = []
    for target in sorted(GRAPH[module]):
        tpkg = _package(target)
        if tpkg == pkg or target in UPWARD_ALLOWED:
            continue
        if LAYER[tpkg] >= layer and not (layer == LAYER["shardps"] and tpkg == "shardps.examples"):
            # up, or sideways between the worker and the server
            bad.append(target)
    assert not bad, f"{module} ({pkg}) imports {bad}"


def test_nothing_of_the_product_imports_testing():
    """shardps.testing is for the tests and benchmarks/ only: no module outside it imports it."""
    bad = {m: sorted(t for t in GRAPH[m] if _package(t) == "shardps.testing") for m in MODULES
           if _package(m) != "shardps.testing"}
    assert not {m: t for m, t in bad.items() if t}


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(GRAPH[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circles():
    assert _circles() == []


def test_the_checker_sees_a_circle_and_an_arrow_up():
    """The checks above can fail: a graph with a circle and the server importing the worker."""
    saved = dict(GRAPH)
    try:
        GRAPH["shardps.protos.codec"] = GRAPH["shardps.protos.codec"] | {"shardps.protos.framing"}
        GRAPH["shardps.protos.framing"] = GRAPH["shardps.protos.framing"] | {"shardps.protos.codec"}
        assert ["shardps.protos.codec", "shardps.protos.framing"] in _circles()
        GRAPH["shardps.server.sync"] = GRAPH["shardps.server.sync"] | {"shardps.worker.client"}
        with pytest.raises(AssertionError, match="shardps.server.sync"):
            test_arrows_point_down("shardps.server.sync")
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_benchmarks_stand_on_the_package_not_on_the_tests():
    """benchmarks/ imports the installed package (shardps.testing for what it shares with the tests), never
    tests/ (nor puts the repository on sys.path to reach it)."""
    bad = {}
    for f in sorted((ROOT / "benchmarks").rglob("*.py")):
        tree = ast.parse(f.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if any(n == "tests" or n.startswith("tests.") for n in names):
            bad[f.name] = sorted(n for n in names if n.split(".")[0] == "tests")
    assert not bad, f"benchmarks importing tests/: {bad}"
