"""The store and its parts import no gRPC and ask the sync policy nothing through its class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"
CORE = ["store", "table", "membership", "apply", "pullcache", "snapshot", "replica", "peers", "sync", "checkpoint"]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("name", CORE)
def test_no_grpc_in_the_store_or_its_parts(name):
    mods = _imports(SERVER / f"{name}.py")
    bad = {m for m in mods if m.split(".")[0] in ("grpc", "grpc_health") or m.endswith(("ps_pb2_grpc", ".exchange",
                                                                                          ".replication", ".service"))}
    assert not bad, f"server/{name}.py imports {sorted(bad)}"
    for m in mods:  # nor through another server module
        if m.startswith("shardps.server.") and m.split(".")[2] not in ("optim", "errors", "remedies", "scaling"):
            assert m.split(".")[2] in CORE, f"server/{name}.py imports {m}"


@pytest.mark.parametrize("name", CORE)
def test_no_isinstance_on_policies(name):
    text = (SERVER / f"{name}.py").read_text()
    assert "isinstance(self._policy" not in text and "BarrierPolicy)" not in text
