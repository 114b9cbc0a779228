"""The committed gRPC/protobuf stubs match ``ps.proto`` and ``experts.proto`` and the pinned runtimes.

``make proto`` (``python -m shardps.codegen``) regenerates the stubs
under ``protos/shardps/v1/``; this test regenerates them into a scratch folder
and fails when the committed files differ (a ``.proto`` edit without
``make proto``, or a generated file edited or reformatted by hand or by a
linter). It also checks that the grpcio/protobuf runtimes, installed and
pinned in ``pyproject.toml``, are at least the versions the stubs were
generated for: older runtimes refuse to import them.
"""

from __future__ import annotations

import difflib
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from shardps import codegen

REPO = Path(__file__).resolve().parents[1]
STUB_DIR = REPO / "protos" / "shardps" / "v1"
PYPROJECT = REPO / "pyproject.toml"

_FIX = "run `make proto` (python -m shardps.codegen) and commit the regenerated stubs"


def _project_dependencies(section: str | None = None) -> list[Requirement]:
    """``[project] dependencies`` (or one optional-dependencies ``section``)."""
    text = PYPROJECT.read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: read the quoted requirement lines.
        if section is None:
            m = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        else:
            m = re.search(rf"^{re.escape(section)}\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        assert m, f"no {section or 'dependencies'} list in {PYPROJECT}"
        lines = [ln.split("#", 1)[0] for ln in m.group(1).splitlines()]
        deps = re.findall(r'"([^"]+)"', "\n".join(lines))
    else:
        project = tomllib.loads(text)["project"]
        deps = project["dependencies"] if section is None else project["optional-dependencies"][section]
    return [Requirement(d) for d in deps]


def _pin(name: str, section: str | None = None) -> Requirement:
    reqs = [r for r in _project_dependencies(section) if r.name.lower() == name]
    where = f"[project.optional-dependencies] {section}" if section else "[project] dependencies"
    assert len(reqs) == 1, f"expected exactly one {name!r} requirement in {where} of {PYPROJECT}, got {reqs}"
    return reqs[0]


def _lower_bound(req: Requirement) -> Version | None:
    """The highest lower bound the specifier set puts on the version."""
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", ">", "==", "~=", "===")]
    return max(bounds, default=None)


def _generated_grpc_version() -> Version:
    text = (STUB_DIR / "ps_pb2_grpc.py").read_text()
    m = re.search(r"^GRPC_GENERATED_VERSION\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    assert m, f"no GRPC_GENERATED_VERSION in {STUB_DIR / 'ps_pb2_grpc.py'}"
    return Version(m.group(1))


def _generated_protobuf_version() -> Version:
    text = (STUB_DIR / "ps_pb2.py").read_text()
    m = re.search(r"^# Protobuf Python Version:\s*(\S+)", text, re.M)
    assert m, f"no '# Protobuf Python Version:' header in {STUB_DIR / 'ps_pb2.py'}"
    return Version(m.group(1))


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("stubs")
    texts = codegen.generate(out)
    # generate() both returns the texts and writes them to out_dir.
    assert set(texts) == set(codegen.GENERATED)
    for name, text in texts.items():
        assert (out / name).read_text() == text
    return texts


def test_codegen_targets_the_committed_folder() -> None:
    assert Path(codegen.PROTO_DIR) == REPO / "protos", (
        f"shardps.codegen is imported from {codegen.__file__}, not from this checkout "
        f"({REPO}): install the project with `pip install -e .`"
    )
    for rel in codegen.PROTO_FILES:
        assert (codegen.PROTO_DIR / rel).is_file(), rel
    assert set(codegen.GENERATED) == set(STUBS)


STUBS = ["ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py", "experts_pb2.py", "experts_pb2.pyi", "experts_pb2_grpc.py"]


@pytest.mark.parametrize("name", STUBS)
def test_committed_stub_is_up_to_date(regenerated: dict[str, str], name: str) -> None:
    committed_path = STUB_DIR / name
    assert committed_path.is_file(), f"{committed_path} is missing: {_FIX}"
    committed = committed_path.read_text()
    fresh = regenerated[name]
    if committed != fresh:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(keepends=True),
                fresh.splitlines(keepends=True),
                fromfile=f"committed {committed_path.relative_to(REPO)}",
                tofile="regenerated from the .proto files",
                n=1,
            )
        )
        if len(diff) > 4000:
            diff = diff[:4000] + "\n... (diff truncated)\n"
        pytest.fail(f"{committed_path.relative_to(REPO)} is out of date: {_FIX}.\n{diff}", pytrace=False)


def test_stubs_import_under_the_installed_package_path() -> None:
    # The stubs were generated for the import path shardps.protos.shardps.v1
    # (not a top-level `protos` or `shardps.v1` package).
    from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc

    assert ps_pb2.DESCRIPTOR.name == "shardps/protos/shardps/v1/ps.proto"
    assert ps_pb2.DESCRIPTOR.package == "shardps.v1"
    assert "from shardps.protos.shardps.v1 import ps_pb2" in (STUB_DIR / "ps_pb2_grpc.py").read_text()
    for service in ("Workers", "Operator", "Peers"):
        assert hasattr(ps_pb2_grpc, f"{service}Stub")
        assert hasattr(ps_pb2_grpc, f"add_{service}Servicer_to_server")


def test_installed_grpcio_is_at_least_the_generated_version() -> None:
    import grpc

    need = _generated_grpc_version()
    have = Version(grpc.__version__)
    assert have >= need, (
        f"grpcio {have} is installed but the committed stubs need grpcio>={need}: "
        f"`pip install -U 'grpcio>={need}'`, or regenerate the stubs with an older grpcio-tools"
    )
    assert Version(metadata.version("grpcio")) == have


def test_pyproject_pins_grpcio_at_least_the_generated_version() -> None:
    need = _generated_grpc_version()
    for name in ("grpcio", "grpcio-health-checking"):
        req = _pin(name)
        low = _lower_bound(req)
        assert low is not None and low >= need, (
            f"pyproject.toml requires {req}, but the committed stubs were generated for "
            f"grpcio {need} (GRPC_GENERATED_VERSION in ps_pb2_grpc.py) and refuse to import on "
            f"older runtimes: require {name}>={need}"
        )


def test_pyproject_pins_grpcio_tools_to_the_generated_version() -> None:
    # `make proto` must reproduce the committed stubs exactly: the dev extra
    # pins the grpcio-tools that generated them, and that is what is installed.
    need = _generated_grpc_version()
    req = _pin("grpcio-tools", "dev")
    assert req.specifier.contains(str(need)), f"dev extra has {req}; the stubs were generated by {need}"
    assert Version(metadata.version("grpcio-tools")) == need, (
        f"grpcio-tools {metadata.version('grpcio-tools')} is installed, the stubs were generated by "
        f"{need}: `pip install -e '.[dev]'`"
    )


def test_protobuf_runtime_is_at_least_the_gencode_version() -> None:
    import google.protobuf

    need = _generated_protobuf_version()
    have = Version(google.protobuf.__version__)
    assert have >= need, f"protobuf {have} is installed; ps_pb2.py was generated for protobuf>={need}"
    low = _lower_bound(_pin("protobuf"))
    assert low is not None and low >= need, (
        f"pyproject.toml requires {_pin('protobuf')}; ps_pb2.py was generated for protobuf {need} "
        f"and refuses older runtimes: require protobuf>={need}"
    )
