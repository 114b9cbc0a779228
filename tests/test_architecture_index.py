"""docs/architecture.md's module index names every module of the package, and only modules that exist.

Regression pinned: the page did not mention 21 modules (the TCP path, the experts, the stream stages among
them), and nothing noticed. The index is the section "## Module index": one ``- `path`: ...`` line per module
of shardps/, protos/, server/, worker/, deploy/ and examples/ (the generated stubs aside).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shardps", "protos", "server", "worker", "deploy", "examples")
LINE = re.compile(r"^- `([\w/.]+\.py)`: (.+)$", re.M)


def _index() -> dict[str, str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Module index\n", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Module index' section"
    body = section[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in LINE.finditer(body)}


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for top in PACKAGES for p in (ROOT / top).rglob("*.py")
            if "_pb2" not in p.name and "__pycache__" not in p.parts}


def test_every_module_is_in_the_index_and_every_line_names_a_module():
    index, modules = _index(), _modules()
    assert not sorted(modules - set(index)), f"modules missing from the index: {sorted(modules - set(index))}"
    assert not sorted(set(index) - modules), f"the index names modules that do not exist: " \
                                             f"{sorted(set(index) - modules)}"
    assert all(line.strip() for line in index.values())
