"""The README's code runs as printed: a new user's first hour starts there.

The first Python block is run as it is. The multi-process form is run as it
is too: the servers with the README's own ``shardps server`` lines and the
workers with its ``train.py`` and environment, only the ports replaced by
free ones (a fixed port may be taken on a shared machine).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardps.deploy.local import read_ready, stop_processes
from tests.helpers import chosen_port

pytestmark = pytest.mark.cluster  # servers, processes or a venv: not in make test-fast

README = Path(__file__).resolve().parents[1] / "README.md"
BIN = Path(sys.executable).parent


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _free_port() -> int:
    return chosen_port()  # below the ephemeral range: nothing else takes it before its process binds it


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDPS_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_first_example_trains_as_printed(tmp_path):
    [code] = [b for b in blocks("python") if "LocalCluster" in b]
    script = tmp_path / "example.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=_env(),
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"[\d.]+(?:e-?\d+)?", p.stdout.split("final loss of each worker:")[1])]
    assert len(losses) == 2 and max(losses) < 1.0, p.stdout  # from about 8 at the start


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_multi_process_example_trains_as_printed(tmp_path):
    [shell] = [b for b in blocks("sh") if "train.py" in b]
    [code] = [b for b in blocks("python") if b.startswith("# train.py")]
    (tmp_path / "train.py").write_text(code)
    ports = {p: str(_free_port()) for p in re.findall(r"--port (\d+)", shell)}
    lines = [ln.split("#")[0].strip().rstrip("&").strip() for ln in shell.splitlines()]
    for old, new in ports.items():
        lines = [ln.replace(old, new) for ln in lines]
    server_cmds = [shlex.split(ln) for ln in lines if ln.startswith("shardps server")]
    [export] = [ln for ln in lines if ln.startswith("export ")]
    env = _env()
    env.update(kv.split("=", 1) for kv in shlex.split(export)[1:])
    worker_envs = [dict([kv.split("=", 1)]) for kv in re.findall(r"(SHARDPS_\w+=\S+) python train\.py", shell)]
    assert len(server_cmds) == 2 and len(worker_envs) == 2, (server_cmds, worker_envs)
    servers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for cmd in server_cmds]
    try:
        for s in servers:
            read_ready(s, 60)
        workers = [subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path, env={**env, **we},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for we in worker_envs]
        for k, w in enumerate(workers):
            out, err = w.communicate(timeout=180)
            assert w.returncode == 0, err[-3000:]
            loss = float(re.search(rf"worker {k}: loss ([\d.]+)", out).group(1))
            assert loss < 1.0, out
    finally:
        stop_processes(servers)
