"""Every path of the project that the docs, docstrings and comments cite exists.

Read from README.md, docs/ (but docs/history/, the dated records) and every Python file of the project (the
generated stubs aside): tokens such as ``worker/tp/split.py`` or ``docs/streaming.md`` under one of the
project's top-level folders. A path of the installed package (``shardps/protos/...``: pyproject.toml's
package-dir mapping) or of the proto tree (``shardps/v1/ps.proto``, under protos/) counts as its source's;
placeholders (``benchmarks/X.py``, ``server/optim/NAME.py``) and globs are not paths. Regressions pinned:
deploy/demo.py cited a ``deploy/demo_gpt.py`` and shardps/ray.py a ``tests/test_ray_import.py``, neither of
which existed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("server", "worker", "protos", "deploy", "shardps", "examples", "benchmarks", "tests", "docs", ".ci")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(t) for t in TOPS) + r")/[\w./-]*[\w-]"
                  r"\.(?:py|md|yml|yaml|json|png|sh|proto|toml|txt|gz|jsonl|cfg|ini))")
INSTALLED = {"shardps/server/": "server/", "shardps/worker/": "worker/", "shardps/protos/": "protos/",
             "shardps/deploy/": "deploy/", "shardps/examples/": "examples/", "shardps/v1/": "protos/shardps/v1/"}


def _sources() -> list[Path]:
    # docs/history/ keeps dated records as they were written: the paths they cite are those of their day
    out = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "history" not in p.parts)]
    for top in TOPS[:-2]:
        out += [p for p in sorted((ROOT / top).rglob("*.py")) if "_pb2" not in p.name and ".venv" not in p.parts]
    return [p for p in out if p != Path(__file__).resolve()]  # this file names missing paths on purpose


def _exists(cited: str) -> bool:
    if (ROOT / cited).exists():
        return True
    return any(cited.startswith(a) and (ROOT / (b + cited[len(a):])).exists() for a, b in INSTALLED.items())


def _placeholder(cited: str) -> bool:
    stem = cited.rsplit("/", 1)[-1].split(".")[0]
    return "*" in cited or "<" in cited or (stem.isupper() and len(stem) <= 4)


def test_every_cited_path_exists():
    missing: dict[str, set[str]] = {}
    for src in _sources():
        for m in PATH.finditer(src.read_text()):
            cited = m.group(1)
            if not _placeholder(cited) and not _exists(cited):
                missing.setdefault(cited, set()).add(str(src.relative_to(ROOT)))
    assert not missing, "cited but missing: " + "; ".join(f"{c} (in {', '.join(sorted(s))})"
                                                           for c, s in sorted(missing.items()))


def test_the_check_finds_a_missing_path():
    assert PATH.findall("see deploy/demo_gpt.py and docs/x.md.") == ["deploy/demo_gpt.py", "docs/x.md"]
    assert not _exists("deploy/demo_gpt.py") and _exists("shardps/v1/ps.proto") and _exists("worker/tp/split.py")
    assert _placeholder("benchmarks/X.py") and _placeholder("server/optim/NAME.py")
    assert not _placeholder("benchmarks/fuzz.py")
