"""NetCluster on real namespaces: shaped rates, cuts, partitions, shardps across hosts, `shardps sim`, cleanup.

Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root): without them these tests skip with the one line
``shardps.netsim.unavailable()`` says (CI runs as root here, so they run). The pure parts (rates, names,
arguments) run everywhere. Rates are asserted as ratios and generous bands, never as times.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardps.cli import main
from shardps.deploy import netns
from shardps.deploy import netsim as impl
from shardps.deploy.local import wait_gone
from shardps.netsim import NetCluster, format_rate, parse_rate, sweep_stale, unavailable
from tests.helpers import ETCD_MISSING

REASON = unavailable()


def needs_netns(test):
    """Real namespaces and processes: skipped (with the reason) where this process cannot make them, and not
    in make test-fast."""
    return pytest.mark.cluster(pytest.mark.skipif(REASON is not None, reason=REASON or "")(test))

ROOT = Path(__file__).resolve().parents[1]

# ---- pure parts ------------------------------------------------------------------------------------------------

RATES = [("1gbit", 10**9), ("500mbit", 5 * 10**8), ("200mbit", 2 * 10**8), ("2.5gbit", 25 * 10**8),
         ("800kbit", 8 * 10**5), (" 100MBIT ", 10**8)]


@pytest.mark.parametrize("text,bits", RATES)
def test_rates_parse(text, bits):
    assert parse_rate(text) == bits
    assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("text", ["1g", "500 mbit", "fast", "", "0mbit", "-5mbit", "1kbit", "mbit"])
def test_a_bad_rate_is_a_clear_error(text):
    with pytest.raises(ValueError, match="expected a number followed by kbit, mbit or gbit"):
        parse_rate(text)


def test_tbf_burst_holds_a_gso_packet_and_grows_with_the_rate():
    assert impl.tbf_args(10**8)[:3] == ["tbf", "rate", "100000000bit"]
    assert int(impl.tbf_args(10**8)[4]) == 128 * 1024  # 4 ms of 100 Mbit/s is 50 KB: the 64 KiB floor
    assert int(impl.tbf_args(10**10)[4]) == 10**10 // 8 // 250


def test_names_addresses_and_bad_arguments_without_touching_the_network():
    c = NetCluster(3, "200mbit", links={"h2": "50mbit", 0: "1gbit"}, prefix="spstest")
    assert c.names == ["h0", "h1", "h2"] and c.rates == {"h0": 10**9, "h1": 2 * 10**8, "h2": 5 * 10**7}
    assert [c.host(i) for i in range(3)] == [f"{c.subnet}.{i}" for i in (1, 2, 3)] and c.host("h1") == c.host(1)
    assert c.subnet.startswith("10.") and c.namespaces == ["spstest-h0", "spstest-h1", "spstest-h2", "spstest-br"]
    assert c.command("h1", ["true"])[:4] == ["ip", "netns", "exec", "spstest-h1"]
    with pytest.raises(ValueError, match="no host 'h7'; the hosts are h0, h1, h2"):
        c.host("h7")
    with pytest.raises(ValueError, match="two or more"):
        c.partition({"h0"})
    with pytest.raises(ValueError, match="in two groups"):
        c.partition({"h0", "h1"}, {"h1"})
    with pytest.raises(ValueError, match="longer than an interface name"):
        NetCluster(["averylonghostname"])
    with pytest.raises(ValueError, match="link rate 'quick'"):
        NetCluster(2, "quick")
    with pytest.raises(RuntimeError, match="not up"):
        c.start("h0", ["true"])


@pytest.mark.cluster  # a process
def test_without_the_capabilities_it_refuses_in_one_line():
    """`shardps sim` as root with CAP_NET_ADMIN and CAP_SYS_ADMIN dropped (or as a plain user): one line, exit 2."""
    drop = ["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-net_admin,-sys_admin"]
    if os.geteuid() != 0:
        drop = []
    elif subprocess.run(["which", "setpriv"], capture_output=True).returncode != 0:
        pytest.skip("setpriv (util-linux) is needed to drop capabilities as root")
    proc = subprocess.run([*drop, sys.executable, "-m", "shardps", "sim", "--hosts", "2", "--servers", "1",
                           "--workers", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs CAP_NET_ADMIN and CAP_SYS_ADMIN" in lines[0] and "lacks" in lines[0], lines


@pytest.mark.parametrize("argv,message", [
    (["--hosts", "3", "--servers", "2", "--workers", "2"], "fewer than --servers 2"),
    (["--link", "fast"], "link rate 'fast'"),
    (["--host-link", "h1"], "expected HOST=RATE")])
def test_sim_flags_are_checked_before_anything_starts(argv, message, capsys):
    try:
        rc = main(["sim", *argv])
    except SystemExit as e:  # argparse's errors
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err


# ---- on real namespaces ----------------------------------------------------------------------------------------

# One per host: a sink on SINK_PORT (reads a connection to its end, answers "<bytes> <seconds from the first
# byte to the end>") and commands on stdin, one answer line each.
AGENT = textwrap.dedent("""
    import socket, sys, threading, time
    def sink(conn):
        with conn:
            n, first = 0, None
            while True:
                b = conn.recv(1 << 20)
                if not b:
                    break
                first = first or time.monotonic()
                n += len(b)
            conn.sendall(f"{n} {time.monotonic() - (first or time.monotonic())}".encode())
    def serve(srv):
        while True:
            threading.Thread(target=sink, args=(srv.accept()[0],), daemon=True).start()
    threading.Thread(target=serve, args=(socket.create_server(("0.0.0.0", 7000)),), daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, addr, *rest = line.split()
        try:
            with socket.create_connection((addr, 7000), timeout=float(rest[-1])) as s:
                if cmd == "send":
                    s.settimeout(None)
                    s.sendall(b"x" * int(rest[0]))
                    s.shutdown(socket.SHUT_WR)
                    print("ok", s.recv(100).decode(), flush=True)
                else:
                    print("ok", flush=True)
        except OSError as e:
            print("fail", type(e).__name__, flush=True)
""")


class Agent:
    """A host's AGENT, asked one line at a time with a deadline."""

    def __init__(self, net: NetCluster, host: str) -> None:
        self.proc = net.start(host, [sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        assert self._answer(30) == "ready"

    def _answer(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout).strip()
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout}s") from None

    def ask(self, line: str, timeout: float) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def connects(self, addr: str, timeout: float = 0.5) -> bool:
        return self.ask(f"connect {addr} {timeout}", timeout + 10).startswith("ok")

    def connects_within(self, addr: str, deadline_s: float) -> bool:
        """Whether a connection succeeds before the deadline (a healed link: ARP and the port come back)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.connects(addr):
                return True
        return False

    def rate_mbit(self, addr: str, nbytes: int) -> float:
        """Mbit/s of ``nbytes`` sent to ``addr``'s sink, as the receiver timed them."""
        answer = self.ask(f"send {addr} {nbytes} 5", 60).split()
        assert answer[0] == "ok" and int(answer[1]) == nbytes, answer
        return nbytes * 8 / float(answer[2]) / 1e6


@pytest.fixture(scope="module")
def net() -> Iterator[tuple[NetCluster, dict[str, Agent]]]:
    """Three hosts: h0 and h1 at 100 Mbit/s, h2 a straggler at 25 Mbit/s; an agent on each. Tests that change
    the network put it back."""
    if REASON is not None:
        pytest.skip(REASON)
    with NetCluster(3, "100mbit", links={"h2": "25mbit"}) as c:
        yield c, {h: Agent(c, h) for h in c.names}


@needs_netns
def test_links_run_at_their_shaped_rate_and_a_straggler_at_its_own(net):
    c, agents = net
    fast = agents["h0"].rate_mbit(c.host("h1"), 3_000_000)
    slow = agents["h0"].rate_mbit(c.host("h2"), 1_000_000)
    assert 50 < fast < 130, fast  # 100 Mbit/s
    assert 12.5 < slow < 32.5, slow  # 25 Mbit/s
    assert 2.5 < fast / slow < 6, (fast, slow)


@needs_netns
def test_shape_changes_a_rate_mid_run(net):
    c, agents = net
    c.shape("h1", "25mbit")
    try:
        slow = agents["h0"].rate_mbit(c.host("h1"), 1_000_000)
        assert 12.5 < slow < 32.5, slow
    finally:
        c.shape("h1", "100mbit")
    fast = agents["h2"].rate_mbit(c.host("h1"), 1_000_000)  # h2 uploads at its 25 Mbit/s: h1 is not the limit
    assert 12.5 < fast < 32.5 and c.rates["h1"] == 10**8, fast


@needs_netns
def test_cut_stops_traffic_and_heal_restores_it(net):
    c, agents = net
    assert agents["h0"].connects(c.host("h1"))
    c.cut("h1")
    try:
        assert not agents["h0"].connects(c.host("h1"))
        assert not agents["h1"].connects(c.host("h2"))
        assert agents["h0"].connects(c.host("h2"))  # the others still talk
    finally:
        c.heal("h1")
    assert agents["h0"].connects_within(c.host("h1"), 15)


@needs_netns
def test_partition_blocks_between_groups_not_within(net):
    c, agents = net
    c.partition({"h0", "h2"}, {"h1"})
    try:
        assert agents["h0"].connects(c.host("h2")) and agents["h2"].connects(c.host("h0"))
        for a, b in (("h0", "h1"), ("h1", "h0"), ("h2", "h1")):
            assert not agents[a].connects(c.host(b)), (a, b)
        c.partition({"h0"}, {"h1"})  # a new partition replaces the old one; h2, in no group, reaches both
        # (within a deadline: h2's failed ARP for h1 is retried on the kernel's 1 s timer)
        assert agents["h2"].connects_within(c.host("h1"), 15) and agents["h2"].connects(c.host("h0"))
        assert not agents["h0"].connects(c.host("h1"))
    finally:
        c.partition()
    assert agents["h0"].connects_within(c.host("h1"), 15)


WORKER = textwrap.dedent("""
    import json, sys, torch, shardps
    address, k = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    with shardps.connect([address], worker_id=k, num_workers=2) as client:
        opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.SGD(lr=0.1), sync="bsp")
        for step in range(3):
            g = torch.Generator().manual_seed(10 * k + step)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        print(json.dumps({"shm": [link is not None for link in client.shm_links], "steps": opt.local_steps,
                          "paths": [type(p).__name__ for p in client.paths],
                          "weights": sum(p.numel() * 4 for p in model.parameters())}))
""")


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@needs_netns
def test_shardps_across_hosts_takes_tcp_and_on_one_host_shared_memory(net):
    """A server on h0; worker 1 on h1 (its bytes cross the link: the data connection) and worker 0 on h0 itself (the
    same host's /dev/shm: shared memory), one bsp job. Hosts share no /dev/shm with each other or this machine."""
    c, _ = net
    [server] = c.start_servers(["h0"])
    try:
        # the server was forked from this process's fork server into h0 (deploy.netns.enter_host): h0's network
        # namespace, a mount namespace of its own; the worker on h0 (started fresh) reaches its segments below
        from shardps.deploy.spawn import spawner

        sp = spawner()
        assert sp is not None and _ppid(server.proc.pid) == sp.pid
        assert os.stat(f"/proc/{server.proc.pid}/ns/net").st_ino == os.stat(f"/run/netns/{c.netns('h0')}").st_ino
        assert os.stat(f"/proc/{server.proc.pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        done = c.run("h1", [sys.executable, "-m", "shardps", "health", "--address", server.address],
                   timeout=60)  # forked too
        assert done.returncode == 0 and "SERVING" in done.stdout, done
        tx0 = c.traffic("h1")[0]
        workers = [c.start(h, [sys.executable, "-c", WORKER, server.address, str(k)], stdout=subprocess.PIPE,
                           cwd=str(ROOT)) for k, h in enumerate(("h0", "h1"))]
        out = []
        for w in workers:
            stdout, _ = w.communicate(timeout=120)
            assert w.returncode == 0
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        on_h0, on_h1 = out
        assert on_h1["shm"] == [False] and on_h0["shm"] == [True]
        assert on_h1["paths"] == ["ConnPath"] and on_h0["paths"] == ["ShmConnPath"]  # frames; on h0 with shm
        assert on_h1["steps"] == on_h0["steps"] == 3
        assert c.traffic("h1")[0] - tx0 > 3 * on_h1["weights"]  # its three pushes crossed h1's link
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)


@needs_netns
@pytest.mark.skipif(shutil.which("etcd") is None, reason=ETCD_MISSING)
def test_sim_trains_digits_end_to_end():
    """With --coordinator: etcd on the host left over (h3), the server fenced through it."""
    proc = subprocess.run([sys.executable, "-m", "shardps", "sim", "--hosts", "4", "--link", "500mbit",
                           "--host-link", "h3=200mbit", "--servers", "1", "--workers", "2", "--epochs", "2",
                           "--push-window", "1", "--coordinator", "--json", "--quiet"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["coordinator"].startswith("etcd://") and out["coordinator"].endswith(".4:2379"), out
    assert out["test_accuracy"] > 0.7 and out["steps"] == 2 * 22, out
    assert out["hosts"] == 4 and out["link"] == "500mbit" and out["host_links"] == {"h3": "200mbit"}
    assert set(out["mb_sent"]) == {"h0", "h1", "h2"} and min(out["mb_sent"].values()) > 0.1, out


# ---- nothing left behind ---------------------------------------------------------------------------------------

def _leftovers(prefix: str) -> list[str]:
    """Whatever of the run ``prefix`` is still on the machine: namespaces, links, /dev/shm dirs, its record."""
    out = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                       timeout=10).stdout.split() if ns.startswith(prefix)]
    out += [ln for ln in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                                        timeout=10).stdout.splitlines() if prefix in ln]
    out += [str(p) for p in Path("/dev/shm").glob(f"{prefix}-*")]
    out += [str(p) for p in netns.RECORDS.glob(f"{prefix}.json")]
    return out


@needs_netns
def test_close_leaves_nothing():
    with NetCluster(2, "1gbit") as c:
        sleeper = c.start("h0", ["sleep", "600"])
        daemon = c.run("h1", ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"], timeout=10)
        assert _leftovers(c.prefix) != [] and sleeper.poll() is None
    assert _leftovers(c.prefix) == []
    assert wait_gone([sleeper.pid, int(daemon.stdout)], timeout=10) == []  # a process that left its session too


OWNER = textwrap.dedent("""
    import json, sys
    from shardps.netsim import NetCluster
    c = NetCluster(2, "1gbit").up()
    p = c.start("h1", ["sleep", "600"])
    print(json.dumps({"prefix": c.prefix, "pid": p.pid}), flush=True)
    sys.stdin.read()
""")


def _owner() -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the owner exited with {proc.wait(timeout=30)}"
    return proc, json.loads(line)


@needs_netns
def test_sigterm_to_the_owner_leaves_nothing():
    proc, run = _owner()
    assert _leftovers(run["prefix"]) != []
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # it still dies of the signal, after cleaning up
    assert _leftovers(run["prefix"]) == [] and wait_gone([run["pid"]], timeout=10) == []


@needs_netns
def test_stale_sweep_removes_what_a_killed_owner_left():
    proc, run = _owner()
    proc.kill()
    proc.wait(timeout=30)
    assert _leftovers(run["prefix"]) != []
    orphan = "sps0e0e0e-h0"  # a namespace of the family with no record (its owner died before writing one)
    subprocess.run(["ip", "netns", "add", orphan], check=True, timeout=10)
    try:
        assert {run["prefix"], "sps0e0e0e"} <= set(sweep_stale())
    finally:
        subprocess.run(["ip", "netns", "delete", orphan], capture_output=True, timeout=10)
    assert _leftovers(run["prefix"]) == [] and _leftovers("sps0e0e0e") == []
    assert wait_gone([run["pid"]], timeout=10) == []
