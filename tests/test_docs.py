"""The docs cannot drift: every metric, CLI flag and environment variable they name exists.

Read from README.md and docs/*.md: metric names (``shardps_*``), ``shardps
<command> --flag`` lines (checked against that command's parser, ``ctl``
actions included), ``benchmarks/X.py --flag`` lines (against that script's
``add_argument`` calls), lone ``--flag`` code spans (against all of them),
and ``SHARDPS_*`` variables (against ``shardps.protos.env``; and every
variable there must be documented).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from torch import nn

from shardps.cli import build_parser
from shardps.deploy.lifeline import LIFELINE_FD
from shardps.protos import env
from shardps.server.metrics import ServerMetrics
from shardps.server.store import ShardStore
from shardps.worker.experts.moe import MoECollector
from shardps.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _text() -> str:
    # Commands continued over lines with a backslash are read as one line.
    return "\n".join(p.read_text().replace("\\\n", " ") for p in DOCS)


def _metric_names() -> set[str]:
    reg = CollectorRegistry()
    ServerMetrics(ShardStore(0, 1, sync="bsp", num_workers=1), reg)
    WorkerMetrics(reg, 0)
    reg.register(MoECollector(nn.Module()))  # shardps.nn.MoE layers' counters (docs/moe.md)
    names = set()
    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}
    for family in reg.collect():  # labelled metrics have no samples until observed: name them by type
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return names


def _options(p: argparse.ArgumentParser) -> set[str]:
    """Every option string of a parser and of its subparsers, recursively."""
    out = {o for a in p._actions for o in a.option_strings}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _options(sub)
    return out


def _commands() -> dict[str, set[str]]:
    parser = build_parser()
    top = {o for a in parser._actions for o in a.option_strings}
    [subs] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: _options(sub) | top for name, sub in subs.choices.items()}


def _benchmark_flags() -> dict[str, set[str]]:
    """Each benchmark's flags by its name; ``baselines/NAME``: the references the benchmarks run."""
    scripts = [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks" / "baselines").glob("*.py")]
    return {(p.stem if p.parent.name == "benchmarks" else f"baselines/{p.stem}"):
            set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", p.read_text())) for p in scripts}


def _example_flags() -> set[str]:
    """The flags of the examples run as modules (``python -m shardps.examples.gpt_stream --blocks``)."""
    return set().union(*(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", p.read_text())
                         for p in (ROOT / "examples").glob("*.py")))


def test_every_metric_the_docs_name_exists():
    named = set(re.findall(r"\bshardps_[a-z_]+[a-z]", _text()))
    assert named, "no metric found in the docs"
    assert sorted(named - _metric_names()) == []


def test_every_metric_is_documented():
    text = (ROOT / "docs" / "metrics.md").read_text()
    families = {n for n in _metric_names() if not re.search(r"_(bucket|count|sum|created)$", n)}
    # prometheus_client names a counter family without its _total; the sample carries it.
    missing = [n for n in families if n not in text and f"{n}_total" not in text]
    assert sorted(missing) == []


def test_every_flag_the_docs_name_exists():
    text = _text()
    commands, benchmarks = _commands(), _benchmark_flags()
    wrong = []
    for sub, rest in re.findall(r"\bshardps ([a-z]+(?:/[a-z]+)*)((?:[^`\n#|])*)", text):
        for name in sub.split("/"):
            if name not in commands:
                continue  # prose such as "shardps server: optimizer step"
            wrong += [f"shardps {name} {f}" for f in FLAG.findall(rest) if f not in commands[name]]
    for script, rest in re.findall(r"benchmarks/([a-z_]+)\.py((?:[^`\n#|])*)", text):
        assert script in benchmarks, f"benchmarks/{script}.py is named in the docs but does not exist"
        wrong += [f"benchmarks/{script}.py {f}" for f in FLAG.findall(rest) if f not in benchmarks[script]]
    known = set().union(*commands.values(), *benchmarks.values(), _example_flags())
    for span in re.findall(r"`(--[^`]*)`", text):  # a lone flag in a code span: some command has it
        wrong += [f for f in FLAG.findall(span) if f not in known]
    assert wrong == []


def test_every_variable_the_docs_name_exists_and_every_variable_is_documented():
    named = set(re.findall(r"\bSHARDPS_[A-Z_]+[A-Z]", _text()))
    assert sorted(named - set(env.ALL) - {LIFELINE_FD}) == []
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert [v for v in env.ALL if v not in operations] == []


@pytest.mark.parametrize("command", ["server", "worker", "demo", "stats", "ctl"])
def test_help_names_what_the_command_takes(command, capsys):
    """The help of each command renders (argparse formats every help string) and mentions its
    environment variables; `demo --help` offers every sync mode (it used to omit ssp:S)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    if command in ("worker", "stats", "ctl"):
        assert env.ADDRESSES in out
    if command == "demo":
        assert "ssp:S" in out and "every:X" in out


def test_the_project_text_names_no_tracker_issue():
    """Code, docs and comments say what is true of the project, not which tracker issue asked for it (an
    upstream project's issue, named with its project, is a reference; docs/history/ keeps dated records)."""
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\b(?<!pytorch )(?<!ray )(?<!megatron )issue( #?\d+|'s)", re.I)
    sources = [root / "README.md", *(p for p in (root / "docs").rglob("*.md") if "history" not in p.parts)]
    sources += [p for top in ("server", "worker", "protos", "deploy", "shardps", "examples", "benchmarks", "tests")
                for p in (root / top).rglob("*.py") if "_pb2" not in p.name and p != Path(__file__).resolve()]
    found = [f"{p.relative_to(root)}:{n}" for p in sources for n, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, f"tracker issues named in: {found}"
