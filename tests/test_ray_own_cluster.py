"""Ray clusters of the tests' own, not the session's: `shardps ray` that starts one for its run, and a
cluster whose Python lacks shardps. Outside the Ray groups (tests/conftest.py), so they run beside the
sessions' clusters in another process; their starts take tests/raystart.py's lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from shardps.deploy.local import wait_gone
from shardps.deploy.ray.local import RayLocalCluster
from tests.raystart import ray_start_lock
from tests.test_ray import _submit, _summary

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_shardps_ray_without_a_cluster_starts_one_big_enough_for_the_run_and_leaves_nothing(tmp_path):
    """No --address, no RAY_ADDRESS, no cluster it can find (a RAY_TMPDIR of its own: the session's cluster
    may run beside it): Ray starts one for the run with as many logical CPUs as it asks for (4 here), also
    on a machine with fewer cores, and it ends with the run."""
    tmp = Path(tempfile.mkdtemp(prefix="shardps-ray-", dir="/tmp"))  # short: Ray's socket paths live here
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
        with ray_start_lock():  # the run starts its cluster at once and ends it with the run
            p = subprocess.run([sys.executable, "-m", "shardps", "ray", "--servers", "2", "--workers", "2",
                                "--epochs", "1", "--json"], capture_output=True, text=True, env=env, timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["steps"] == 22 and out["test_accuracy"] > 0.5
        if (os.cpu_count() or 1) < 4:
            assert f"local Ray with 4 logical CPUs for 4 asked on {os.cpu_count()} cores" in p.stderr
        left = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout.split()
        assert not left or wait_gone([int(x) for x in left], 30), f"processes of the run's Ray left: {left}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(600)
def test_a_cluster_without_shardps_gets_it_through_py_modules(tmp_path):
    """A cluster whose Python has torch, grpcio and Ray but not shardps: the job ships shardps itself
    (py_modules: the package directory from the wheel), no pip on the cluster."""
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "ray").is_dir())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    bare = tmp_path / "venv" / "bin" / "python"
    # The main environment's packages, without the .pth files that put shardps there: only a site
    # directory runs them, a path listed in a .pth file does not.
    own_site = subprocess.run([str(bare), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(own_site, "deps.pth").write_text(site + "\n")
    assert subprocess.run([str(bare), "-c", "import ray, torch, grpc; import shardps"], capture_output=True,
                          cwd=tmp_path, timeout=120).returncode == 1  # no shardps there (nor the repository)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("shardps-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "pkg")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    with ray_start_lock():
        rc = RayLocalCluster(num_cpus=4, python=str(bare)).start()
    try:
        rc.wait_for_jobs()
        p = _submit(rc, ["python", "-m", "shardps", "ray", "--servers", "1", "--workers", "2", "--epochs", "1",
                         "--json"], python=str(bare), runtime_env={"py_modules": [str(tmp_path / "pkg" / "shardps")]},
                    cwd=job_dir)
        out = _summary(p)
    finally:
        rc.stop()
    assert out["test_accuracy"] > 0.7 and out["steps"] == 22  # one epoch learns (0.82): test_ray_job_submit_...
