"""The store and its parts: no gRPC, a tree of parts (each imports only parts below it). (No import circle
anywhere, and the layers of the whole house: tests/test_layering.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"

# The store's parts, bottom up, by their path under server/ ("rows.table" is server/rows/table.py): a module
# imports only server modules of a lower layer (lazy and TYPE_CHECKING imports included). optim/ is a package of
# its own below them all.
LAYERS = [
    ["errors", "replication.roles", "rows.index", "parked"],
    ["remedies", "scaling", "sync", "replication.peers", "checkpoint"],
    ["table", "job", "membership", "rows.table", "rows.reshard", "experts.heldgrads"],
    ["rows.tables"],
    ["datapath.apply", "datapath.reader", "replication.snapshot"],
    ["replication.state", "datapath.slicepull"],
    ["datapath.path", "datapath.slicepush"],
    ["store"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
RANK["optim"] = -1
CORE = [name for layer in LAYERS for name in layer]


def _file(name: str) -> Path:
    return SERVER / (name.replace(".", "/") + ".py")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # from shardps.server.rows import reshard
    return out


def _server_modules(path: Path) -> set[str]:
    """The server modules ``path`` imports, by their path under shardps.server (optim for that package)."""
    out = set()
    for m in _imports(path):
        if not m.startswith("shardps.server."):
            continue
        parts = m.split(".")[2:]
        if parts[0] == "optim":
            out.add("optim")
            continue
        for n in range(len(parts), 0, -1):  # the module itself, not a name in it
            if _file(".".join(parts[:n])).exists():
                out.add(".".join(parts[:n]))
                break
    return out


@pytest.mark.parametrize("name", CORE)
def test_no_grpc_in_the_store_or_its_parts(name):
    mods = _imports(_file(name))
    bad = {m for m in mods if m.split(".")[0] in ("grpc", "grpc_health") or m.endswith(("ps_pb2_grpc", ".exchange",
                                                                                          ".transport", ".service"))}
    assert not bad, f"server/{name} imports {sorted(bad)}"


@pytest.mark.parametrize("name", CORE)
def test_a_part_imports_only_parts_below_it(name):
    for m in sorted(_server_modules(_file(name))):
        assert m in RANK, f"server/{name} imports server/{m}, which is not one of the store's parts"
        assert RANK[m] < RANK[name], (f"server/{name} (layer {RANK[name]}) imports server/{m} "
                                      f"(layer {RANK[m]}): parts import only parts below them")


@pytest.mark.parametrize("name", CORE)
def test_no_mixins_and_no_isinstance_on_policies(name):
    text = _file(name).read_text()
    assert "Mixin" not in text, f"server/{name}: the store is made of parts, not mixins"
    assert "isinstance(self._policy" not in text and "BarrierPolicy)" not in text


def test_every_arrow_between_parts_points_down():
    """Every import between the parts, at once (the parametrized test above says which one broke)."""
    assert all(RANK[m] < RANK[n] for n in CORE for m in _server_modules(_file(n)) if m in RANK)
