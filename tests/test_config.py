"""One configuration rule everywhere: the argument, then its SHARDPS_* variable, then the default.

Every variable of ``shardps.protos.env`` is exercised here, through the Python
API and the CLI alike (the last test checks that none is forgotten).
"""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

import shardps
from shardps.cli import build_parser
from shardps.protos import env
from shardps.protos.security import Security


@pytest.fixture
def clean_env(monkeypatch):
    for name in env.ALL:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_arguments_win_then_variables_then_defaults(clean_env):
    assert env.pick("arg", env.METRICS_HOST, "default") == "arg"
    assert env.pick(None, env.METRICS_HOST, "default") == "default"
    clean_env.setenv(env.METRICS_HOST, "0.0.0.0")
    assert env.pick(None, env.METRICS_HOST, "default") == "0.0.0.0"
    assert env.pick("arg", env.METRICS_HOST, "default") == "arg"
    clean_env.setenv(env.METRICS_PORT, "94o0")
    with pytest.raises(ValueError, match="SHARDPS_METRICS_PORT='94o0' is not an integer"):
        env.pick_int(None, env.METRICS_PORT)
    assert env.pick_int(9400, env.METRICS_PORT) == 9400  # an argument is not even parsed from the variable


@pytest.mark.cluster
def test_connect_takes_addresses_worker_id_num_workers_and_backups_from_the_environment(clean_env, cluster2):
    with pytest.raises(ValueError, match="SHARDPS_ADDRESSES"):
        shardps.connect()
    clean_env.setenv(env.ADDRESSES, ",".join(cluster2.addresses))
    clean_env.setenv(env.WORKER_ID, "1")
    clean_env.setenv(env.NUM_WORKERS, "3")
    clean_env.setenv(env.BACKUPS, "127.0.0.1:1,127.0.0.1:2")
    with shardps.connect() as c:
        assert (c.addresses, c.worker_id, c.num_workers) == (cluster2.addresses, 1, 3)
        assert c.backups == ["127.0.0.1:1", "127.0.0.1:2"]
    with shardps.connect(cluster2.addresses[:1], worker_id=0, num_workers=1, backups=[""]) as c:  # arguments win
        assert (c.addresses, c.worker_id, c.num_workers, c.backups) == (cluster2.addresses[:1], 0, 1, [""])
    # SHARDPS_BACKUPS belongs to SHARDPS_ADDRESSES: shards given here (one of them, say) do not take it
    with shardps.connect(cluster2.addresses[:1]) as c:
        assert c.backups == [""]


@pytest.mark.cluster
@pytest.mark.parametrize("how", [env.AUTH_TOKEN, env.AUTH_TOKEN_FILE])
def test_connect_sends_the_token_from_the_environment(clean_env, make_cluster, tmp_path, how):
    """Found by a new user: the CLI honoured SHARDPS_AUTH_TOKEN, shardps.connect() did not."""
    cluster = make_cluster(1, security=Security(token="s3cret"))
    with pytest.raises(shardps.ShardError) as err, \
            shardps.connect(cluster.addresses, ready_timeout=10, recovery_timeout=0) as c:
        c.stats()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    if how == env.AUTH_TOKEN:
        clean_env.setenv(env.AUTH_TOKEN, "s3cret")
    else:
        (tmp_path / "token").write_text("s3cret\n")
        clean_env.setenv(env.AUTH_TOKEN_FILE, str(tmp_path / "token"))
    with shardps.connect(cluster.addresses, ready_timeout=10) as c:
        c.register({"w": torch.zeros(3)}, shardps.optim.SGD(), sync="asp")
        assert c.stats()[0]["registered_workers"] == [0]


@pytest.mark.parametrize("from_file", [False, True])
@pytest.mark.parametrize("role,var,file_var", [("worker", env.WORKER_TOKEN, env.WORKER_TOKEN_FILE),
                                               ("operator", env.OPERATOR_TOKEN, env.OPERATOR_TOKEN_FILE),
                                               ("peer", env.PEER_TOKEN, env.PEER_TOKEN_FILE)])
def test_each_audiences_token_comes_from_the_environment(clean_env, tmp_path, role, var, file_var, from_file):
    if from_file:
        (tmp_path / "token").write_text("r0le\n")
        clean_env.setenv(file_var, str(tmp_path / "token"))
    else:
        clean_env.setenv(var, "r0le")
    sec = Security.from_env()
    assert sec.token is None and {r: t for r, t in sec.role_tokens.items() if t} == {role: "r0le"}
    assert sec.token_for(role) == "r0le"


@pytest.mark.cluster
def test_connect_sends_the_worker_token_from_the_environment(clean_env, make_cluster):
    cluster = make_cluster(1, security=Security(worker_token="w0rker", operator_token="0perator"))
    clean_env.setenv(env.WORKER_TOKEN, "w0rker")
    with shardps.connect(cluster.addresses, ready_timeout=10) as c:
        c.register({"w": torch.zeros(3)}, shardps.optim.SGD(), sync="asp")
        assert c.stats()[0]["registered_workers"] == [0]
        with pytest.raises(shardps.ShardError) as err:  # no operator token: set_sync is the operator's
            c.set_sync("bsp")
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_tls_settings_come_from_the_environment(clean_env, tmp_path):
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("x")
    clean_env.setenv(env.TLS_CERT, str(tmp_path / "cert"))
    clean_env.setenv(env.TLS_KEY, str(tmp_path / "key"))
    clean_env.setenv(env.TLS_CA, str(tmp_path / "ca"))
    clean_env.setenv(env.TLS_SERVER_NAME, "shardps-server")
    s = Security.from_env()
    assert (s.tls_cert, s.tls_key, s.tls_ca, s.server_name) == (
        str(tmp_path / "cert"), str(tmp_path / "key"), str(tmp_path / "ca"), "shardps-server")
    assert Security.from_env(server_name="other").server_name == "other"
    cluster = shardps.LocalCluster(1)  # the Python API follows the same rule (not started here)
    assert cluster.security.tls_cert == str(tmp_path / "cert")


@pytest.mark.cluster
def test_a_python_worker_serves_its_metrics_where_the_environment_says(clean_env, cluster2):
    """Found by a new user: SHARDPS_METRICS_PORT/HOST, documented for every worker, worked only for servers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clean_env.setenv(env.METRICS_PORT, str(port))
    clean_env.setenv(env.METRICS_HOST, "127.0.0.1")
    model = torch.nn.Linear(4, 2)
    with shardps.connect(cluster2.addresses) as client:
        assert client.metrics_endpoint is None  # only a registered worker serves
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert client.metrics_endpoint is not None and client.metrics_endpoint.port == port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'shardps_worker_steps_total{worker="0"} 3.0' in body


def test_the_cli_follows_the_same_rule(clean_env, tmp_path):
    p = build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["worker"])  # no addresses, no ids: argparse names what is missing
    clean_env.setenv(env.ADDRESSES, "h:1,h:2")
    clean_env.setenv(env.WORKER_ID, "1")
    clean_env.setenv(env.NUM_WORKERS, "2")
    clean_env.setenv(env.LOG_LEVEL, "INFO")
    clean_env.setenv(env.CHECKPOINT_DIR, str(tmp_path))
    clean_env.setenv(env.METRICS_PORT, "9411")
    clean_env.setenv(env.METRICS_HOST, "0.0.0.0")
    p = build_parser()
    a = p.parse_args(["worker"])
    assert (a.addresses, a.worker_id, a.num_workers, a.log_level) == (["h:1", "h:2"], 1, 2, "INFO")
    assert a.metrics_port is None  # resolved by connect() from the same variable, like the Python API
    a = p.parse_args(["worker", "--addresses", "x:3", "--worker-id", "0"])
    assert (a.addresses, a.worker_id) == (["x:3"], 0)
    s = p.parse_args(["server"])
    assert (s.checkpoint_dir, s.metrics_port, s.metrics_host) == (str(tmp_path), 9411, "0.0.0.0")
    assert p.parse_args(["stats"]).addresses == ["h:1", "h:2"]
    assert p.parse_args(["ctl", "checkpoint"]).addresses == ["h:1", "h:2"]


def test_a_server_is_configured_by_its_variables(clean_env):
    """What a container of the compose file uses: one `shardps server` command, the rest variables."""
    values = {env.HOST: "0.0.0.0", env.PORT: "7000", env.SHARD_INDEX: "1", env.NUM_SHARDS: "2",
              env.LEASE_SECONDS: "30", env.REPLICAS: "2", env.REPLICA_PORT: "7100",
              env.REPLICA_TARGET: "server0:7100", env.ADVERTISE_ADDRESS: "server1:7000",
              env.CHECKPOINT_EVERY: "500", env.FRAME_INLINE_BYTES: "0", env.COORDINATOR: "etcd://etcd:2379",
              env.JOB: "digits"}
    for k, v in values.items():
        clean_env.setenv(k, v)
    s = build_parser().parse_args(["server"])
    assert (s.host, s.port, s.shard_index, s.num_shards, s.lease_seconds) == ("0.0.0.0", 7000, 1, 2, 30.0)
    assert (s.replicas, s.replica_port, s.replica_target) == (2, 7100, "server0:7100")
    assert (s.advertise_address, s.checkpoint_every) == ("server1:7000", 500)
    assert s.frame_inline_bytes == 0
    assert (s.coordinator, s.job) == ("etcd://etcd:2379", "digits")
    assert build_parser().parse_args(["server", "--job", "other"]).job == "other"
    assert build_parser().parse_args(["server", "--frame-inline-bytes", "4096"]).frame_inline_bytes == 4096
    s = build_parser().parse_args(["server", "--port", "7001", "--shard-index", "0"])
    assert (s.port, s.shard_index) == (7001, 0)
    assert build_parser().parse_args(["health"]).address == "127.0.0.1:7000"  # the container's own server
    clean_env.setenv(env.LEASE_SECONDS, "0")  # 0 is a value (no leases), not "unset"
    assert build_parser().parse_args(["server"]).lease_seconds == 0.0
    clean_env.setenv(env.REPLICAS, "3")
    from shardps.cli import main

    assert main(["server"]) == 2  # argparse checks the choices of flags only: shardps checks the variable's
    clean_env.setenv(env.REPLICAS, "2")
    clean_env.setenv(env.LEASE_SECONDS, "soon")
    with pytest.raises(SystemExit, match="SHARDPS_LEASE_SECONDS='soon' is not a number"):
        build_parser()


def test_channels_ping_after_the_keepalive_and_a_bad_value_names_the_variable(clean_env):
    """SHARDPS_KEEPALIVE_S sets the pings of every channel (default 10 s, half of it to answer), 0 turns them
    off; the reconnect backoff stays at most 2 s either way; a value that is not seconds >= 0 is refused."""
    from shardps.protos.security import keepalive_options

    opts = dict(keepalive_options())
    assert (opts["grpc.keepalive_time_ms"], opts["grpc.keepalive_timeout_ms"]) == (10_000, 5_000)
    assert opts["grpc.max_reconnect_backoff_ms"] == 2_000
    clean_env.setenv(env.KEEPALIVE_S, "1.5")
    assert dict(keepalive_options())["grpc.keepalive_timeout_ms"] == 750
    clean_env.setenv(env.KEEPALIVE_S, "0")
    assert "grpc.keepalive_time_ms" not in dict(keepalive_options())
    for bad in ("soon", "-1", "nan"):
        clean_env.setenv(env.KEEPALIVE_S, bad)
        with pytest.raises(ValueError, match=f"SHARDPS_KEEPALIVE_S={bad!r}"):
            keepalive_options()
        with pytest.raises(ValueError, match="SHARDPS_KEEPALIVE_S"):
            Security().channel("127.0.0.1:1")


def test_every_variable_is_tested_here():
    text = Path(__file__).read_text()
    missing = [name for name in env.ALL if f"env.{name.removeprefix('SHARDPS_')}" not in text]
    assert missing == []


@pytest.mark.cluster
def test_the_shared_memory_path_follows_the_argument_then_the_variable(clean_env, cluster2):
    def links(**kw):
        with shardps.connect(cluster2.addresses, **kw) as c:
            c.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=0.1))
            return [link is not None for link in c.shm_links]

    assert links() == [True, True]  # on by default (the shards share this machine)
    clean_env.setenv(env.SHM, "0")
    assert links() == [False, False]
    assert links(shm=True) == [True, True]  # an argument wins
    clean_env.setenv(env.SHM, "maybe")
    with pytest.raises(ValueError, match="SHARDPS_SHM='maybe'"):
        shardps.connect(cluster2.addresses)


@pytest.mark.cluster
def test_server_processes_are_forked_unless_the_variable_says_0(clean_env):
    from shardps.deploy import spawn
    from shardps.deploy.spawn import ForkedProcess

    # A fork server this test process started earlier may hold another environment (a test's variable, set
    # then): its children would start fresh, rightly. This one starts its own, with this environment.
    clean_env.setattr(spawn, "_shared", None)
    try:
        with shardps.LocalCluster(1, processes=True) as cluster:
            assert [type(p) for p in cluster._procs] == [ForkedProcess]  # on by default (deploy/spawn.py)
    finally:
        if spawn._shared is not None:
            spawn._shared.close()
    clean_env.setenv(env.FORK, "0")
    with shardps.LocalCluster(1, processes=True) as cluster:
        assert [type(p) for p in cluster._procs] == [subprocess.Popen]
    clean_env.setenv(env.FORK, "maybe")
    with pytest.raises(ValueError, match="SHARDPS_FORK='maybe'"):
        shardps.LocalCluster(1, processes=True).start()


def test_the_backup_is_advertised_on_the_advertised_host():
    """A server process's backup port is named in the coordinator with --advertise-address's host (a container's
    service name), not the machine's host name; without the flag, as its main port is."""
    from shardps.server.app import advertised, advertised_beside

    assert advertised_beside("server1:7000", "0.0.0.0", 7100) == "server1:7100"
    assert advertised_beside("[::1]:7000", "::", 7100) == "[::1]:7100"
    assert advertised_beside(None, "10.0.0.5", 7100) == "10.0.0.5:7100" == advertised("10.0.0.5", 7100)


def test_shardps_worker_takes_the_backups_of_the_addresses_from_the_environment(clean_env):
    from shardps.cli import worker_backups

    clean_env.setenv(env.ADDRESSES, "h:1,h:2")
    clean_env.setenv(env.BACKUPS, "b:1,b:2")
    clean_env.setenv(env.WORKER_ID, "0")
    clean_env.setenv(env.NUM_WORKERS, "1")
    p = build_parser()
    a = p.parse_args(["worker"])
    assert worker_backups(a.addresses, a.backups) == ["b:1", "b:2"]
    a = p.parse_args(["worker", "--backups", "c:1,c:2"])  # an argument wins
    assert worker_backups(a.addresses, a.backups) == ["c:1", "c:2"]
    # The variable names the backups of SHARDPS_ADDRESSES' shards, as for connect(): not of shards given here
    a = p.parse_args(["worker", "--addresses", "x:3"])
    assert worker_backups(a.addresses, a.backups) is None


@pytest.mark.cluster
def test_a_local_clusters_server_processes_take_its_settings_not_the_environments(clean_env, tmp_path):
    """A LocalCluster decides its servers' settings from its arguments, in process mode as in process: the
    variables that configure a `shardps server` where no flag is given do not reach its processes."""
    import socket

    held = socket.socket()  # a metrics port already taken: a server that took the variable would not start
    held.bind(("127.0.0.1", 0))
    try:
        clean_env.setenv(env.METRICS_PORT, str(held.getsockname()[1]))
        clean_env.setenv(env.CHECKPOINT_DIR, str(tmp_path))
        clean_env.setenv(env.CHECKPOINT_EVERY, "1")
        clean_env.setenv(env.COORDINATOR, "etcd://127.0.0.1:1")  # nothing listens there
        clean_env.setenv(env.JOB, "someone-elses")
        with shardps.LocalCluster(1, processes=True, startup_timeout=60) as cluster:
            clean_env.delenv(env.METRICS_PORT)  # (a worker takes it too: this one serves none)
            with shardps.connect(cluster.addresses, worker_id=0, num_workers=1) as client:
                client.register({"w": torch.zeros(4)}, shardps.optim.SGD(lr=0.1), sync="bsp")
                client.push({"w": torch.ones(4)}, step=0)
                assert torch.allclose(client.pull(["w"])["w"], torch.full((4,), -0.1))
        assert list(tmp_path.iterdir()) == []  # no checkpoint: the cluster was given no directory
    finally:
        held.close()
