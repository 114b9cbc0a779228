"""The store and its parts: no gRPC, a tree of parts (each imports only parts below it). (No import circle
anywhere, and the layers of the whole house: tests/test_layering.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"

# The store's parts, bottom up: a module imports only server modules of a lower layer (lazy and TYPE_CHECKING
# imports included). optim/ is a package of its own below them all.
LAYERS = [
    ["errors", "roles", "rowindex", "parked"],
    ["remedies", "scaling", "sync", "peers", "checkpoint"],
    ["table", "job", "membership", "rowtable", "rowreshard", "heldgrads"],
    ["rows"],
    ["apply", "pullcache", "snapshot"],
    ["replica", "slicepull"],
    ["datapath", "slicepush"],
    ["store"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
RANK["optim"] = -1
CORE = [name for layer in LAYERS for name in layer]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "shardps.server":  # from shardps.server import part
                out |= {f"shardps.server.{a.name}" for a in node.names}
    return out


def _server_modules(path: Path) -> set[str]:
    """The server modules ``path`` imports, by first name under shardps.server (optim for the package)."""
    return {m.split(".")[2] for m in _imports(path) if m.startswith("shardps.server.")}


@pytest.mark.parametrize("name", CORE)
def test_no_grpc_in_the_store_or_its_parts(name):
    mods = _imports(SERVER / f"{name}.py")
    bad = {m for m in mods if m.split(".")[0] in ("grpc", "grpc_health") or m.endswith(("ps_pb2_grpc", ".exchange",
                                                                                          ".replication", ".service"))}
    assert not bad, f"server/{name}.py imports {sorted(bad)}"


@pytest.mark.parametrize("name", CORE)
def test_a_part_imports_only_parts_below_it(name):
    for m in sorted(_server_modules(SERVER / f"{name}.py")):
        assert m in RANK, f"server/{name}.py imports server/{m}, which is not one of the store's parts"
        assert RANK[m] < RANK[name], (f"server/{name}.py (layer {RANK[name]}) imports server/{m} "
                                      f"(layer {RANK[m]}): parts import only parts below them")


@pytest.mark.parametrize("name", CORE)
def test_no_mixins_and_no_isinstance_on_policies(name):
    text = (SERVER / f"{name}.py").read_text()
    assert "Mixin" not in text, f"server/{name}.py: the store is made of parts, not mixins"
    assert "isinstance(self._policy" not in text and "BarrierPolicy)" not in text


def test_every_arrow_between_parts_points_down():
    """Every import between the parts, at once (the parametrized test above says which one broke)."""
    assert all(RANK[m] < RANK[n] for n in CORE for m in _server_modules(SERVER / f"{n}.py") if m in RANK)
