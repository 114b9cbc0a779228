"""The built wheel installs one top-level package, ``shardps``, that works.

The source folders ``server/``, ``worker/``, ``protos/``, ``deploy/`` and
``examples/`` map onto ``shardps.*`` through ``[tool.setuptools.package-dir]``
and an explicit package list, so a subpackage missing from that list, a data
file missing from package-data, or a module that imports ``server`` instead of
``shardps.server`` only shows up in an installed wheel: the editable install
used for development hides all of those. This test builds the wheel from a
clean copy of the checkout, checks its file list, installs it into a fresh
virtualenv (runtime dependencies are borrowed from this environment through
a ``.pth`` file, so nothing is downloaded) and imports it from there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"

# Mirrors [tool.setuptools.package-dir]; checked against pyproject.toml below.
PACKAGE_DIRS = {
    "shardps": "shardps",
    "shardps.server": "server",
    "shardps.worker": "worker",
    "shardps.protos": "protos",
    "shardps.deploy": "deploy",
    "shardps.examples": "examples",
}
SOURCE_ROOTS = sorted(set(PACKAGE_DIRS.values()) - {"shardps"})
# Runtime dependencies (import names) the fresh venv borrows from this one.
RUNTIME_MODULES = ("torch", "grpc", "grpc_health", "google.protobuf", "numpy", "tqdm")
REQUIRED_FILES = (
    "shardps/__init__.py",
    "shardps/py.typed",
    "shardps/cli.py",
    "shardps/protos/shardps/v1/ps.proto",
    "shardps/protos/shardps/v1/ps_pb2.py",
    "shardps/protos/shardps/v1/ps_pb2.pyi",
    "shardps/protos/shardps/v1/ps_pb2_grpc.py",
    "shardps/examples/data/digits.csv.gz",
)
# Copied into the scratch build tree only when git cannot list the checkout.
_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
    ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis", "out",
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_NO_CACHE_DIR="1",
    )
    return env


def _run(cmd: list[str | Path], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [str(c) for c in cmd]
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}", pytrace=False)
    return proc


def _check(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if proc.returncode != 0:
        pytest.fail(
            f"exit code {proc.returncode}: {' '.join(proc.args)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    return proc


def _copy_checkout(dest: Path) -> None:
    """Copy what a fresh clone would hold (tracked + untracked, not ignored files)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, timeout=30, check=True,
        ).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        shutil.copytree(REPO, dest, ignore=_IGNORE)
        return
    for rel in filter(None, listed):
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def _purelib(python: Path, cwd: Path) -> Path:
    out = _check(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd, 60))
    return Path(out.stdout.strip())


def _site_dir_of(module: str) -> Path:
    """The sys.path entry ``module`` is imported from in this environment."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"runtime dependency {module!r} is not installed"
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        pkg = Path(spec.origin).parent if spec.submodule_search_locations is not None else Path(spec.origin)
    else:
        pkg = Path(next(iter(spec.submodule_search_locations or [])))
    # up one level per dotted component (a package: past its folder; a module: past the file)
    site = pkg
    for _ in module.split("."):
        site = site.parent
    return site.resolve()


def _pip_can_target_other_python() -> bool:
    try:
        major, minor = (int(x) for x in metadata.version("pip").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (22, 3)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the project's wheel from a scratch copy of the checkout.

    A copy, so that a stale ``build/lib`` in the checkout cannot leak deleted
    modules into the wheel, and the build writes nothing into the checkout.
    """
    root = tmp_path_factory.mktemp("wheel")
    src, out = root / "src", root / "dist"
    _copy_checkout(src)
    assert (src / "pyproject.toml").is_file()
    cmd: list[str | Path] = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out]
    # The build backend is setuptools; build against this environment's when
    # it has one (no download), in an isolated build environment otherwise.
    if importlib.util.find_spec("setuptools") is not None:
        cmd.append("--no-build-isolation")
    cmd.append(src)
    _check(_run(cmd, root, 180))
    wheels = sorted(out.glob("shardps-*.whl"))
    assert len(wheels) == 1, f"expected one shardps wheel in {out}, got {list(out.iterdir())}"
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_package_dirs_match_pyproject() -> None:
    text = PYPROJECT.read_text()
    for pkg, folder in PACKAGE_DIRS.items():
        assert f'"{pkg}" = "{folder}"' in text, f"{pkg} -> {folder} not in [tool.setuptools.package-dir]"


def test_wheel_has_only_the_shardps_package(wheel: Path, wheel_files: list[str]) -> None:
    name, version = wheel.name.split("-")[:2]
    dist_info = f"{name}-{version}.dist-info"
    tops = {PurePosixPath(f).parts[0] for f in wheel_files}
    assert tops == {"shardps", dist_info}, (
        f"top-level entries in {wheel.name}: {sorted(tops)}; everything must live under shardps/ "
        f"(a stray server/, worker/, protos/, deploy/ or examples/ package would shadow other "
        f"distributions)"
    )
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(f"{dist_info}/top_level.txt").decode().split() == ["shardps"]
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "shardps = shardps.cli:main" in entry_points
    assert not [f for f in wheel_files if "__pycache__" in f or f.endswith(".pyc")]
    assert not [f for f in wheel_files if f.startswith(("shardps/tests/", "shardps/benchmarks/"))]


def test_wheel_holds_the_data_files_and_stubs(wheel_files: list[str]) -> None:
    missing = [f for f in REQUIRED_FILES if f not in wheel_files]
    assert not missing, f"missing from the wheel: {missing} (check [tool.setuptools.package-data])"


def test_wheel_holds_every_source_module(wheel: Path, wheel_files: list[str]) -> None:
    # Every .py under the mapped source folders (of the tree the wheel was
    # built from) must be packaged: a new subpackage (e.g. server/foo/) needs
    # an entry in [tool.setuptools] packages.
    src = wheel.parent.parent / "src"
    expected = set()
    for pkg, folder in PACKAGE_DIRS.items():
        base = PurePosixPath(*pkg.split("."))
        for py in (src / folder).rglob("*.py"):
            rel = py.relative_to(src / folder)
            if "__pycache__" in rel.parts:
                continue
            expected.add(str(base / PurePosixPath(*rel.parts)))
    missing = sorted(expected - set(wheel_files))
    assert not missing, (
        f"source modules missing from the wheel: {missing}; add their packages to "
        f"[tool.setuptools] packages in pyproject.toml"
    )


def test_wheel_installs_and_imports_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv, run_dir = tmp_path / "venv", tmp_path / "run"
    run_dir.mkdir()  # cwd for the checks: holds no shardps/, server/, worker/ ...
    # pip >= 22.3 installs into another interpreter (--python): the venv then
    # needs no pip of its own, which saves seeding one (ensurepip) every run.
    outer_pip = _pip_can_target_other_python()
    _check(_run([sys.executable, "-m", "venv", *(["--without-pip"] if outer_pip else []), venv], tmp_path, 120))
    python, script = venv / "bin" / "python", venv / "bin" / "shardps"
    purelib = _purelib(python, run_dir)
    assert purelib.is_dir() and purelib.resolve().is_relative_to(venv.resolve())

    # Borrow the runtime dependencies: plain path lines in a .pth file add
    # those folders to sys.path (after the venv's own site-packages) without
    # running this environment's .pth files, so its editable shardps finder
    # stays inactive there.
    dep_dirs = sorted({_site_dir_of(m) for m in RUNTIME_MODULES}, key=str)
    assert REPO.resolve() not in dep_dirs, dep_dirs
    (purelib / "_shardps_test_deps.pth").write_text("".join(f"{d}\n" for d in dep_dirs))

    pip = [sys.executable, "-m", "pip", "--python", python] if outer_pip else [python, "-m", "pip"]
    _check(_run([*pip, "install", "--no-deps", "--no-index", wheel], run_dir, 120))
    assert script.is_file(), f"pip installed no `shardps` console script in {script.parent}"

    help_out = _check(_run([script, "--help"], run_dir, 60)).stdout
    assert "usage: shardps" in help_out and "server" in help_out and "demo" in help_out, help_out

    probe = r"""
import importlib.util, json, sys
from importlib import resources
import shardps, shardps.server.store, shardps.worker.client
import shardps.protos.shardps.v1.ps_pb2_grpc, shardps.deploy.local, shardps.examples.digits
data = resources.files("shardps.examples").joinpath("data/digits.csv.gz")
typed = resources.files("shardps").joinpath("py.typed")
print(json.dumps({
    "files": {m: sys.modules[m].__file__ for m in (
        "shardps", "shardps.server.store", "shardps.worker.client",
        "shardps.protos.shardps.v1.ps_pb2_grpc", "shardps.deploy.local", "shardps.examples.digits")},
    "data_bytes": len(data.read_bytes()),
    "py_typed": typed.is_file(),
    "top_level": {n: getattr(importlib.util.find_spec(n), "origin", None)
                  for n in ("server", "worker", "protos", "deploy")},
    "sys_path": sys.path,
}))
"""
    out = _check(_run([python, "-c", probe], run_dir, 120)).stdout
    info = json.loads(out.strip().splitlines()[-1])
    for mod, file in info["files"].items():
        path = Path(file).resolve()
        assert path.is_relative_to(purelib.resolve()), (
            f"{mod} imported from {file}, not from the fresh venv's site-packages {purelib}"
        )
        assert not path.is_relative_to(REPO.resolve()), f"{mod} imported from the checkout: {file}"
    assert not any(Path(p).resolve() == REPO.resolve() for p in info["sys_path"] if p), info["sys_path"]
    assert info["data_bytes"] > 1000
    assert info["py_typed"]
    assert info["top_level"] == dict.fromkeys(("server", "worker", "protos", "deploy")), (
        f"top-level modules importable in the fresh venv: {info['top_level']}"
    )
    for name in ("server", "worker"):
        proc = _run([python, "-c", f"import {name}"], run_dir, 60)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (name, proc.stderr)


def test_development_venv_uses_an_editable_install(tmp_path: Path) -> None:
    # `make venv` runs `pip install -e ".[dev]"`: the package is imported from
    # the checkout, with the folder mapping applied.
    import shardps.deploy
    import shardps.protos
    import shardps.server
    import shardps.worker

    assert Path(shardps.__file__).resolve() == REPO / "shardps" / "__init__.py"
    for mod, folder in ((shardps.server, "server"), (shardps.worker, "worker"),
                        (shardps.protos, "protos"), (shardps.deploy, "deploy")):
        assert Path(mod.__file__).resolve() == REPO / folder / "__init__.py", mod.__file__
    # (a shardps.egg-info in the checkout may also be on sys.path: look for
    # the distribution pip installed, the one with a direct_url.json)
    urls = [u for d in metadata.distributions(name="shardps") if (u := d.read_text("direct_url.json"))]
    assert len(urls) == 1, f"expected one pip-installed shardps distribution, got {len(urls)}"
    info = json.loads(urls[0])
    assert info.get("dir_info", {}).get("editable") is True, info
    assert Path(info["url"].removeprefix("file://")).resolve() == REPO
    # The editable install exposes only `shardps`, not the source folders as
    # top-level packages (checked outside the checkout: pytest puts the repo
    # root on sys.path for this process).
    probe = ("import importlib.util as u; "
             "print([n for n in ('server', 'worker', 'protos', 'deploy', 'examples') if u.find_spec(n)])")
    out = _check(_run([sys.executable, "-c", probe], tmp_path, 60)).stdout.strip()
    assert out == "[]", f"top-level packages importable from the development venv: {out}"
