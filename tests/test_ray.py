"""shardps on a real Ray cluster (two nodes on this machine): placement, training, faults, jobs.

The training loops below run inside worker actors; they are module-level
functions, imported there from the repository (the session's working
directory). Faults are injected at exact steps from inside the loops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray
import torch
from ray.util.state import list_actors, list_placement_groups
from torch import nn

import shardps
import shardps.ray as sray
from shardps.deploy.local import wait_gone
from shardps.deploy.ray.local import RayLocalCluster, ray_command
from tests.helpers import ETCD_MISSING

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def exact_loop(ctx: sray.WorkerContext) -> dict[str, torch.Tensor]:
    """bsp training of a small model on per-step data; faults from ``ctx.config`` at exact steps:
    ``kill_pid`` is SIGKILLed by worker ``kill_by`` before its step ``kill_at``; worker ``die`` kills
    itself before step ``kill_at``; worker ``raise_in`` raises there."""
    c = ctx.config
    model = _model()
    opt = shardps.DistributedOptimizer(model, ctx.client, optimizer=shardps.optim.Adam(lr=1e-2), sync="bsp")
    step = 0
    while step < c.get("steps", STEPS):
        if step == c.get("kill_at") and ctx.worker_id == c.get("kill_by") and not c.get("_killed"):
            c["_killed"] = True
            os.kill(c["kill_pid"], signal.SIGKILL)
        if step == c.get("kill_at") and ctx.worker_id == c.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == c.get("kill_at") and ctx.worker_id == c.get("raise_in"):
            raise ValueError(f"a bug in worker {ctx.worker_id}'s training loop at step {step}")
        try:
            g = torch.Generator().manual_seed(step * 10 + ctx.worker_id)
            model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
        except shardps.RolledBack as e:
            opt.zero_grad()
            ctx.report({"rolled_back_to": e.step})
            step = e.step
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def digits_loop(ctx: sray.WorkerContext) -> dict:
    from shardps.examples.digits import train_worker

    out = train_worker(None, None, None, client=ctx.client, epochs=ctx.config.get("epochs", 3),
                       on_step=lambda s, loss: ctx.report({"step": s}) if s % 22 == 0 else None)
    return {"steps": out["steps"], "node_id": ctx.node_id}


def _ours_alive(address: str) -> tuple[list, list]:
    actors = [a for a in list_actors(address=address, filters=[("state", "=", "ALIVE")])
              if a.class_name in ("ServerActor", "WorkerActor")]
    groups = [g for g in list_placement_groups(address=address) if g.state != "REMOVED"]
    return actors, groups


def _assert_nothing_left(rc: RayLocalCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        actors, groups = _ours_alive(rc.address)
        if not actors and not groups:
            return
        assert time.monotonic() < deadline, f"left behind: actors {actors}, placement groups {groups}"
        time.sleep(0.5)  # the state API reports what the GCS has processed: nothing to wait on here


def _node_ids(ray_cluster) -> dict[str, str]:
    """node id -> "head" or "second" (the node with the ps resource)."""
    return {n["NodeID"]: ("second" if "ps" in n["Resources"] else "head") for n in ray.nodes() if n["Alive"]}


# -- the module ----------------------------------------------------------------------------------


def test_import_shardps_does_not_import_ray_and_shardps_ray_says_how_to_install_it():
    code = "import sys, shardps; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120).stdout.strip() == "False"
    code = "import sys; sys.modules['ray'] = None; import shardps.ray"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "pip install 'shardps[ray]'" in p.stderr


def test_an_actors_module_imports_its_own_part_of_the_package_and_every_public_name_resolves():
    """Each actor's process imports its class's module; the package's names come on first use (PEP 562)."""
    code = ("import sys, shardps.deploy.ray.stage_actor; "
            "print(sorted(m for m in sys.modules if m.startswith('shardps.deploy.ray.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "['shardps.deploy.ray.placement', 'shardps.deploy.ray.stage_actor']", p.stderr
    import shardps.deploy.ray as package
    import shardps.ray

    assert sorted(package.__all__) == sorted(package._WHERE)  # the names listed are the names served
    for name in package.__all__:
        assert getattr(package, name) is getattr(shardps.ray, name), name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        package.Nope  # noqa: B018


# -- placement -----------------------------------------------------------------------------------


def test_strict_spread_puts_each_server_on_its_own_node_and_the_job_trains(ray_cluster):
    nodes = _node_ids(ray_cluster)
    with sray.start_servers(2, strategy="STRICT_SPREAD") as servers:
        assert sorted(nodes[n] for n in servers.node_ids) == ["head", "second"]
        reports: list[dict] = []
        results = sray.run_workers(digits_loop, servers, 2, config={"epochs": 3}, on_report=reports.append,
                                   strategy="STRICT_SPREAD")
        assert [r["steps"] for r in results] == [66, 66]
        assert sorted(nodes[r["node_id"]] for r in results) == ["head", "second"]
        assert {r["worker_id"] for r in reports} == {0, 1} and max(r["step"] for r in reports) == 66
        from shardps.examples.digits import evaluate

        assert evaluate(servers.addresses) > 0.85
    _assert_nothing_left(ray_cluster)


def test_a_custom_resource_keeps_the_servers_on_the_nodes_that_have_it(ray_cluster):
    nodes = _node_ids(ray_cluster)
    with sray.start_servers(2, resources={"ps": 0.001}) as servers:
        assert [nodes[n] for n in servers.node_ids] == ["second", "second"]


def test_infeasible_placement_fails_within_its_deadline_naming_bundles_and_nodes(ray_cluster):
    with pytest.raises(sray.PlacementError, match=r"STRICT_SPREAD needs one node per bundle: 3 bundles .*2 alive"):
        sray.start_servers(3, strategy="STRICT_SPREAD")
    with pytest.raises(sray.PlacementError) as err:  # nobody offers this resource: Ray alone would wait forever
        sray.start_servers(1, resources={"tpu_pod": 1}, placement_timeout=3)
    assert "could not be placed within 3s" in str(err.value) and "'tpu_pod': 1" in str(err.value)
    assert "'ps': 1.0" in str(err.value)  # the nodes and what they offer
    with pytest.raises(sray.PlacementError) as err:  # more CPUs than the whole cluster has: said, with a way out
        sray.start_servers(2, num_cpus=50, placement_timeout=2)
    assert "CPU 100 (the cluster has 8 in all)" in str(err.value) and "--server-cpus" in str(err.value)
    _assert_nothing_left(ray_cluster)


# -- faults --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clean_run(ray_session):
    ray_session.running()  # the tests that use it ask for ray_cluster as well: this runs first
    with sray.start_servers(2) as servers:
        return sray.run_workers(exact_loop, servers, 2)


def _assert_same(got, expected):
    for k, (g, e) in enumerate(zip(got, expected)):
        for n in e:
            assert torch.equal(g[n], e[n]), (k, n)


@pytest.mark.fault
@pytest.mark.parametrize("coordinator", [False, True], ids=["alone", "etcd-in-an-actor"])
def test_kill_9_a_server_actor_its_backup_takes_over_and_the_result_is_exact(ray_cluster, clean_run, coordinator):
    """With a coordinator: etcd in an actor (start_etcd), the backup takes over once etcd let the killed
    primary's lease expire (epoch 2), and the etcd process ends with its actor."""
    with contextlib.ExitStack() as stack:
        kw = {}
        if coordinator:
            if shutil.which("etcd") is None:
                pytest.skip(ETCD_MISSING)
            etcd = stack.enter_context(sray.start_etcd())
            kw = {"coordinator": etcd.url, "job": "kill9", "coordinator_ttl": 2}
        servers = stack.enter_context(sray.start_servers(2, replicas=2, **kw))
        config = {"kill_pid": servers.pids[1], "kill_by": 0, "kill_at": 7}
        got = sray.run_workers(exact_loop, servers, 2, config=config)
        if coordinator:
            from shardps.server.coordinator import Etcd, ShardLease, parse

            client = Etcd(parse(etcd.url))
            try:
                record = ShardLease(client, "kill9", 1, "observer:0").read()
            finally:
                client.close()
            assert record is not None and record.epoch == 2 and record.primary == servers.backup_addresses[1]
            etcd_pid = ray.get(etcd.actor.__ray_call__.remote(lambda a: a.etcd.proc.pid))
    _assert_same(got, clean_run)
    if coordinator:
        assert wait_gone([etcd_pid], timeout=30) == [], "etcd outlived its actor"


@pytest.mark.fault
def test_kill_9_a_server_actor_ray_restarts_it_and_the_job_rolls_back_exactly(ray_cluster, clean_run, tmp_path):
    """Checkpoints every 5 steps; worker 0 kills server 1 before its step 12, so the shards are at
    version 12 at most: 10 is on disk, 15 is not. Ray restarts the actor in its bundle, it restores 10
    and serves on its old port; the job rolls back to 10 and finishes as if nothing happened. Leases far
    longer than the restart (under a loaded machine Ray's restart can take many seconds): a worker evicted
    meanwhile would change the steps' sums, which is not what this test is about; should one be, it is
    said first."""
    with sray.start_servers(2, checkpoint_dir=str(tmp_path), checkpoint_every=5, max_restarts=1,
                            lease_s=120.0) as servers:
        before = servers.pids
        config = {"kill_pid": before[1], "kill_by": 0, "kill_at": 12}
        reports: list[dict] = []
        got = sray.run_workers(exact_loop, servers, 2, config=config, on_report=reports.append)
        with shardps.connect(servers.addresses) as c:
            stats = c.stats()
        after = servers.refresh()
    assert [s["evicted_workers"] for s in stats] == [[], []], stats
    assert {r["rolled_back_to"] for r in reports} == {10}, reports
    _assert_same(got, clean_run)
    assert {r["worker_id"] for r in reports} == {0, 1}
    assert after[1]["restarted"] and after[1]["pid"] != before[1] and after[1]["restored"] == 10
    assert [i["address"] for i in after] == servers.addresses


@pytest.mark.fault
def test_a_worker_actor_killed_under_bsp_the_others_go_on(ray_cluster):
    with sray.start_servers(2, lease_s=3.0) as servers:
        reports: list[dict] = []
        with pytest.raises(sray.WorkersFailed) as err:  # with on_report, as shardps ray runs it
            sray.run_workers(exact_loop, servers, 3, config={"die": 2, "kill_at": 5}, on_report=reports.append)
        assert sorted(err.value.results) == [0, 1] and list(err.value.errors) == [2]
        with shardps.connect(servers.addresses) as c:
            stats = c.stats()
    assert all(s["evicted_workers"] == [2] and s["version"] == STEPS for s in stats)
    _assert_nothing_left(ray_cluster)


@pytest.mark.fault
def test_a_failing_training_loop_stops_the_run_and_leaves_nothing_behind(ray_cluster):
    with sray.start_servers(2) as servers:
        with pytest.raises(ValueError, match="a bug in worker 1's training loop at step 3"):
            sray.run_workers(exact_loop, servers, 2, config={"raise_in": 1, "kill_at": 3})
    _assert_nothing_left(ray_cluster)


# -- metrics -------------------------------------------------------------------------------------


def metrics_loop(ctx: sray.WorkerContext) -> str:
    """Train a few steps, then return this worker's own /metrics page."""
    model = nn.Linear(4, 2)
    opt = shardps.DistributedOptimizer(model, ctx.client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    address = ctx.client.metrics_endpoint.address
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def test_actors_serve_their_metrics(ray_cluster):
    with sray.start_servers(2, metrics_port=0) as servers:
        pages = sray.run_workers(metrics_loop, servers, 2, metrics=True)
        assert all(f'shardps_worker_steps_total{{worker="{k}"}} 3.0' in page for k, page in enumerate(pages))
        targets = servers.prometheus_targets()
        assert [t["labels"]["shard"] for t in targets] == ["0", "1"]
        for t in targets:
            with urllib.request.urlopen(f"http://{t['targets'][0]}/metrics", timeout=10) as r:
                body = r.read().decode()
            assert f'shardps_shard_version{{shard="{t["labels"]["shard"]}"}} 3.0' in body


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="Debian's prometheus is not installed (`make test` installs it with apt as root)")
def test_prometheus_finds_the_actors_through_file_sd(ray_cluster, tmp_path):
    """The scrape config docs/ray.md gives: file_sd_configs over the file `shardps ray --prometheus-sd`
    writes (ServerGroup.prometheus_targets()), read by a real Prometheus."""
    from shardps.deploy.ray.job import _write_targets
    from tests.helpers import start_prometheus, stop_prometheus

    with sray.start_servers(2, metrics_port=0) as servers:
        _write_targets(str(tmp_path / "shardps_sd.json"), servers.prometheus_targets())
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: shardps\n    file_sd_configs:\n"
            f"      - files: ['{tmp_path / 'shardps_sd.json'}']\n        refresh_interval: 1s\n")
        proc, prom = start_prometheus(shutil.which("prometheus"), tmp_path)
        try:
            prom.wait_for('count(shardps_shard_version{job="shardps-server"}) == 2')  # both scraped
            series = prom.query('shardps_shard_version{job="shardps-server"}')["data"]["result"]
            assert sorted(s["metric"]["shard"] for s in series) == ["0", "1"]
            assert {s["metric"]["ray_node_id"] for s in series} <= set(servers.node_ids)
        finally:
            stop_prometheus(proc)


# -- ray job submit --------------------------------------------------------------------------------


def _submit(rc: RayLocalCluster, args: list[str], *, python: str | None = None, timeout: float = 600,
            runtime_env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, **rc.env)
    cmd = ray_command(python) + ["job", "submit", "--address", rc.dashboard_url, "--working-dir", "."]
    if runtime_env:
        cmd += ["--runtime-env-json", json.dumps(runtime_env)]
    return subprocess.run(cmd + ["--", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def _summary(p: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"test_accuracy"')]
    assert p.returncode == 0 and lines, p.stdout[-4000:] + p.stderr[-2000:]
    return json.loads(lines[-1])


def test_ray_job_submit_trains_digits(ray_cluster):
    # 3 of the default 10 epochs: 0.9278 in `shardps demo --servers 2 --workers 2 --epochs 3`, the same
    # training (2026-12-04)
    # with a live backup of each shard, fenced through etcd in an actor (where etcd is installed)
    fenced = ["--replicas", "2", "--coordinator", "actor"] if shutil.which("etcd") else []
    p = _submit(ray_cluster, ["shardps", "ray", "--example", "digits", "--servers", "2", "--workers", "2",
                              "--epochs", "3", "--json", *fenced])
    assert "succeeded" in p.stdout + p.stderr
    out = _summary(p)
    if fenced:
        assert out["replicas"] == 2 and out["coordinator"].startswith("etcd://"), out
    assert out["test_accuracy"] >= 0.9 and out["steps"] == 66, out
    assert (out["servers"], out["workers"], out["sync"]) == (2, 2, "bsp")
    nodes = _node_ids(ray_cluster)
    assert set(out["server_nodes"] + out["worker_nodes"]) <= set(nodes)
    assert len(out["server_nodes"]) == 2 and len(out["worker_nodes"]) == 2
    _assert_nothing_left(ray_cluster)


@pytest.mark.fault
def test_ray_job_stop_leaves_nothing_behind(ray_cluster):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_cluster.dashboard_url)
    job = client.submit_job(entrypoint="shardps ray --servers 2 --workers 2 --epochs 500",
                            runtime_env={"working_dir": str(ROOT), "excludes": ["/benchmarks", "/docs"]})
    deadline = time.monotonic() + 180
    while "worker 0: step 20" not in client.get_job_logs(job):  # training has begun
        assert client.get_job_status(job) == JobStatus.RUNNING or time.monotonic() < deadline, \
            client.get_job_logs(job)[-3000:]
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(0.5)  # another process's progress
    env = dict(os.environ, **ray_cluster.env)
    subprocess.run(ray_command() + ["job", "stop", "--address", ray_cluster.dashboard_url, job], check=True,
                   capture_output=True, env=env, timeout=120)
    assert client.get_job_status(job) == JobStatus.STOPPED
    _assert_nothing_left(ray_cluster, timeout=60)


def test_needed_cpus_counts_servers_and_workers_or_stages():
    from shardps.cli import build_parser
    from shardps.deploy.ray.job import needed_cpus

    parse = build_parser().parse_args
    assert needed_cpus(parse(["ray", "--servers", "2", "--workers", "3", "--worker-cpus", "0.5"])) == 3.5
    assert needed_cpus(parse(["ray", "--servers", "2", "--replicas", "2"])) == 4  # backups share server actors
    assert needed_cpus(parse(["ray", "--example", "shakespeare", "--servers", "1", "--stages", "3",
                              "--stage-cpus", "2"])) == 7
    assert needed_cpus(parse(["ray", "--example", "shakespeare", "--servers", "1", "--stages", "2",
                              "--tensor-parallel", "2", "--workers", "2", "--stage-cpus", "0.5"])) == 5
