"""TLS, mutual TLS and bearer tokens, with certificates made in the test (openssl)."""

from __future__ import annotations

import io
import shutil
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import shardps
from shardps.admin import run_promote
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.frames import FrameStub

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certs")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=shardps test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
             "-subj", f"/CN=shardps {who}", cwd=d)
        _run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext", cwd=d)
    # A second, unrelated CA: its certificates must be refused.
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
         "-subj", "/CN=rogue", cwd=d)
    return d


def _roundtrip(addresses, security):
    with shardps.connect(addresses, security=security, ready_timeout=10, recovery_timeout=0) as client:
        client.register({"w": torch.arange(6.0)}, shardps.optim.SGD(lr=1.0), sync="asp")
        client.push({"w": torch.ones(6)}, step=0)
        return client.pull(min_versions=1)["w"]


def test_tls(make_cluster, pki):
    server = Security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    cluster = make_cluster(2, security=server)
    w = _roundtrip(cluster.addresses, Security(tls_ca=str(pki / "ca.pem")))
    assert torch.equal(w, torch.arange(6.0) - 1)
    # A plaintext client, or one trusting another CA, cannot talk to it.
    for bad in (Security(), Security(tls_ca=str(pki / "rogue.pem"))):
        with pytest.raises(shardps.ShardError) as err:
            with shardps.connect(cluster.addresses, security=bad, ready_timeout=None, recovery_timeout=0) as c:
                c.stats()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(make_cluster, pki):
    server = Security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_ca=str(pki / "ca.pem"))
    cluster = make_cluster(1, security=server)
    client = Security(tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"), tls_ca=str(pki / "ca.pem"))
    assert torch.equal(_roundtrip(cluster.addresses, client), torch.arange(6.0) - 1)
    with pytest.raises(shardps.ShardError) as err:
        with shardps.connect(cluster.addresses, security=Security(tls_ca=str(pki / "ca.pem")),
                             ready_timeout=None, recovery_timeout=0) as c:
            c.stats()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_refused_tls_handshake_is_named_with_its_cause(make_cluster, pki):
    """Found by a new user: a mutual-TLS client without a certificate, or checking the wrong server name,
    read only "no parameter server answered within 5s"."""
    ca = str(pki / "ca.pem")
    server = Security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_ca=ca)
    cluster = make_cluster(1, security=server)
    mine = dict(tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"))
    cases = [
        (Security(tls_ca=ca), "requires a client certificate (mutual TLS) and this client has none"),
        (Security(tls_ca=ca, server_name="elsewhere", **mine), "certificate does not carry elsewhere"),
        (Security(tls_ca=str(pki / "rogue.pem"), **mine), "not signed by the CA this client trusts"),
        (Security(), "if it serves TLS, this client speaks plaintext"),
    ]
    for sec, cause in cases:
        with pytest.raises(TimeoutError) as err:
            shardps.connect(cluster.addresses, security=sec, ready_timeout=2)
        assert f"no parameter server answered within 2s at ['{cluster.addresses[0]}']" in str(err.value)
        assert cause in str(err.value), str(err.value)
        with pytest.raises(shardps.ShardError) as err2:  # and the same cause once connected without waiting
            with shardps.connect(cluster.addresses, security=sec, ready_timeout=None, recovery_timeout=0) as c:
                c.stats()
        assert cause in str(err2.value), str(err2.value)


def test_ctl_errors_name_the_endpoint_not_a_shard_minus_one():
    with pytest.raises(shardps.ShardError) as err:  # nothing listens there
        run_promote(["127.0.0.1:1"], timeout=5, out=io.StringIO())
    assert "shard -1" not in str(err.value)
    assert str(err.value).startswith("127.0.0.1:1: UNAVAILABLE: Promote: "), str(err.value)


@pytest.mark.parametrize("tls", [False, True])
def test_token_auth(make_cluster, pki, tls):
    server_tls = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key")) if tls else {}
    client_tls = dict(tls_ca=str(pki / "ca.pem")) if tls else {}
    cluster = make_cluster(1, security=Security(token="s3cret-token", **server_tls), metrics=True)
    w = _roundtrip(cluster.addresses, Security(token="s3cret-token", **client_tls))
    assert torch.equal(w, torch.arange(6.0) - 1)
    store = cluster.stores[0]
    before = store.state_hash()
    for token in (None, "wrong-token"):
        sec = Security(token=token, **client_tls)
        with shardps.connect(cluster.addresses, security=sec, ready_timeout=10, recovery_timeout=0) as c:
            with pytest.raises(shardps.ShardError) as err:
                c.attach()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert ("missing" if token is None else "wrong") in err.value.details
            c.layouts, c.shard_map = {"w": None}, None
        # A push without the token changes nothing: its data connection is not given (Connect is refused).
        channel = sec.channel(cluster.addresses[0])
        chunk = ps_pb2.Chunk(name="w", offset=0, dtype=ps_pb2.FLOAT32, data=torch.ones(6).numpy().tobytes())
        with pytest.raises(grpc.RpcError) as rpc_err, FrameStub(cluster.addresses[0], security=sec) as stub:
            stub.Push([ps_pb2.PushRequest(worker_id=0, step=1, base_version=1, chunk=chunk)], timeout=10)
        assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health checks need no token (load balancers and orchestrators probe them).
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
    assert store.state_hash() == before
    assert cluster.registries[0].get_sample_value(
        "shardps_rpc_errors_total", {"shard": "0", "method": "Connect", "code": "UNAUTHENTICATED"}) == 2


def test_security_settings_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Security(tls_cert="a.pem")
    with pytest.raises(ValueError, match="cannot read TLS certificate"):
        Security(tls_cert=str(tmp_path / "nope.pem"), tls_key="k").server_credentials()
    (tmp_path / "token").write_text("abc123\n")
    monkeypatch.setenv("SHARDPS_AUTH_TOKEN_FILE", str(tmp_path / "token"))
    assert Security.from_env().token == "abc123"
    monkeypatch.delenv("SHARDPS_AUTH_TOKEN_FILE")
    monkeypatch.setenv("SHARDPS_AUTH_TOKEN", "xyz")
    assert Security.from_env().token == "xyz" and Security.from_env(token="explicit").token == "explicit"
    assert Security(token="t", tls_ca="ca").describe() == "TLS + token"


@pytest.mark.cluster
def test_non_loopback_bind_without_tls_warns():
    import signal
    import sys

    from shardps.deploy.local import read_ready

    proc = subprocess.Popen([sys.executable, "-m", "shardps", "server", "--host", "0.0.0.0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        read_ready(proc, 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert "reachable from other machines, without TLS and a token" in err


@pytest.mark.fault
def test_replication_over_mutual_tls_with_a_token(make_cluster, pki):
    """Server to server (Replicate, the takeover's check of the primary) goes over the same mTLS and token."""
    ca = str(pki / "ca.pem")
    server = Security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_ca=ca, token="t0ken")
    cluster = make_cluster(2, security=server, replicas=2)
    client_sec = Security(tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"), tls_ca=ca, token="t0ken")
    backup_of = {b.shard_index: b for b in cluster.backups}
    with shardps.connect(cluster.addresses, security=client_sec, ready_timeout=10, recovery_timeout=10) as client:
        client.register({"w": torch.arange(6.0), "v": torch.zeros(3)}, shardps.optim.SGD(lr=1.0), sync="asp")
        client.push({"w": torch.ones(6), "v": torch.ones(3)}, step=0)
        for st in cluster.stores:
            assert st.stats().replica_state == "synced"
            assert st.state_hash() == backup_of[st.shard_index].state_hash()
        # The backup reads the live primary's Stats (authenticated) and refuses to take over.
        with pytest.raises(shardps.ShardError, match="still answers SERVING"):
            run_promote([client.backups[0]], security=server, out=io.StringIO())
        cluster.stop_server(1)  # shard 0's primary goes away: the client fails over, over mTLS
        client.push({"w": torch.ones(6), "v": torch.ones(3)}, step=1)
        assert torch.equal(client.pull()["w"], torch.arange(6.0) - 2)
        assert client.failovers_total == 1 and backup_of[0].replica.role == "primary"


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_the_data_connection_is_tls_under_tls(make_cluster, pki, mutual):
    """A worker on another machine (shm=False) takes the data connection under TLS too, as TLS with the gRPC
    port's certificates; a connection that does not speak TLS to it is refused before its hello."""
    from shardps.protos import dataconn as wire
    from shardps.worker.datapath.dataconn import ConnPath

    ca = str(pki / "ca.pem")
    server = Security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_ca=ca if mutual else None)
    cluster = make_cluster(2, security=server)
    client_sec = Security(tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"), tls_ca=ca) if mutual \
        else Security(tls_ca=ca)
    with shardps.connect(cluster.addresses, security=client_sec, shm=False, recovery_timeout=0) as client:
        client.register({"w": torch.arange(600.0)}, shardps.optim.SGD(lr=1.0), sync="bsp")
        assert [type(p) for p in client.paths] == [ConnPath, ConnPath]
        conn = client.paths[0].conn
        assert conn.sock.version() is not None  # TLS 1.2 or 1.3
        client.push({"w": torch.ones(600)}, step=0)
        assert torch.equal(client.pull(min_versions=1)["w"], torch.arange(600.0) - 1)
        host, port = conn.where.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as plain:  # a hello in the clear
            plain.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, conn.token, conn.worker_id, 10.0))
            plain.settimeout(10)
            try:
                got = plain.recv(64)
            except ConnectionResetError:
                got = b""
            assert got == b""  # closed (or reset), no ACK
