"""What a partition does to a job, on a simulated cluster (shardps.netsim): docs/operations.md's table.

Each test cuts or partitions hosts between steps the test itself hands out (tests/partition_driver.py runs a
worker in a host, one command at a time), and waits for states (a shard's Stats, a worker's answer) with a
deadline, never for a moment: what they assert does not depend on the machine's speed.

Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root): without them they skip with the one line
``shardps.netsim.unavailable()`` says.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardps.deploy.local import read_ready
from shardps.netsim import NetCluster, unavailable

REASON = unavailable()
ROOT = Path(__file__).resolve().parents[1]
PORT, REF_PORT, REPLICA_PORT = 7000, 7001, 7100  # every host has addresses of its own: fixed ports do
LEASE = 2.0


def needs_netns(test: Callable[..., None]) -> Any:
    """Real namespaces and processes, a fault at an exact point: skipped (with the reason) where this process
    cannot make namespaces."""
    return pytest.mark.fault(pytest.mark.cluster(pytest.mark.skipif(REASON is not None, reason=REASON or "")(test)))


class Driver:
    """tests/partition_driver.py in a host: a JSON command a line in, a JSON answer a line out."""

    def __init__(self, net: NetCluster, host: str, env: dict[str, str] | None = None) -> None:
        self.host = host
        self.proc = net.start(host, [sys.executable, "-m", "tests.partition_driver"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd=str(ROOT), env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.sent: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        self.sent.append(op)

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next answer (``ok`` False: the command raised, ``error`` says what)."""
        try:
            got: dict[str, Any] = json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"{self.host}: no answer to {self.sent[-1:]} within {timeout}s "
                                 f"(exit code {self.proc.poll()})") from None
        return got

    def ok(self, timeout: float = 60.0) -> dict[str, Any]:
        got = self.answer(timeout)
        assert got["ok"], f"{self.host}: {self.sent[-1]}: {got.get('trace') or got}"
        return got

    def ask(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.ok(timeout)

    @property
    def answered(self) -> bool:
        return not self.lines.empty()

    def stats(self, *addresses: str) -> dict[str, dict[str, Any]]:
        """Each endpoint's Stats (worker clocks keyed by int), or ``{"error": ...}`` where it does not answer."""
        # The driver bounds each endpoint's calls by 2 s (connect, then Stats); the answer's own wait is
        # generous, so a loaded machine only makes it late, never a failure.
        out: dict[str, dict[str, Any]] = self.ask("stats", addresses=list(addresses),
                                                  timeout=4.0 * len(addresses) + 60.0)["stats"]
        for s in out.values():
            if "worker_clocks" in s:
                s["worker_clocks"] = {int(k): v for k, v in s["worker_clocks"].items()}
        return out


def drivers(net: NetCluster, hosts: list[str], env: dict[str, str] | None = None) -> list[Driver]:
    """One driver per host, started together; returns once each said it is ready."""
    ds = [Driver(net, h, env) for h in hosts]
    for d in ds:
        assert d.ok(90).get("ready")
    return ds


def server(net: NetCluster, host: str, *args: str, port: int = PORT) -> subprocess.Popen[str]:
    """``shardps server`` bound to the host's address (read its ready line with ``read_ready``)."""
    return net.start(host, [sys.executable, "-m", "shardps", "server", "--host", net.host(host), "--port", str(port),
                            "--lease-seconds", str(LEASE), *args], stdout=subprocess.PIPE)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``probe()`` once it is truthy, polled until ``timeout`` (another process's state: nothing to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s (last: {got!r})"
        time.sleep(0.1)


def each(workers: list[Driver], op: str, timeout: float = 60.0, **args: Any) -> list[dict[str, Any]]:
    for w in workers:
        w.send(op, **args)
    return [w.ok(timeout) for w in workers]


# ---- 1. a worker host cut for longer than its lease ------------------------------------------------------------

@needs_netns
@pytest.mark.timeout(180)
def test_a_worker_cut_longer_than_its_lease_is_evicted_and_rejoins_when_healed():
    """bsp, 3 workers: h3's link goes down between two of its steps. The shard evicts worker 2 after its lease
    (2 s) and the other two go on (the versions advance while h3 is still cut); healed, worker 2's next push is
    refused as evicted, it registers again, pulls the current weights and trains on with the others: every
    worker ends with the weights the shard holds."""
    with NetCluster(4, "1gbit") as net:
        srv = server(net, "h0", "--shard-index", "0", "--num-shards", "1")
        obs, *workers = drivers(net, ["h0", "h1", "h2", "h3"])
        addresses = [read_ready(srv, 60).split()[0]]
        cut = workers[2]
        for k, w in enumerate(workers):
            w.send("join", addresses=addresses, worker=k, workers=3)
        for w in workers:
            w.ok()
        each(workers, "steps", n=2)

        net.cut("h3")
        for w in workers[:2]:
            w.send("steps", n=3)
        wait_for("worker 2 evicted", lambda: obs.stats(*addresses)[addresses[0]]["evicted_workers"] == [2],
                 timeout=30)
        during = [w.ok() for w in workers[:2]]  # the barrier went on without worker 2
        s = obs.stats(*addresses)[addresses[0]]
        assert [d["versions"] for d in during] == [[5], [5]] and not cut.answered
        assert s["version"] == 5 and s["worker_clocks"] == {0: 4, 1: 4, 2: 1} and s["evictions_total"] == 1

        net.heal("h3")
        cut.send("until", version=8)  # its first push is refused (evicted): it registers again, then waits for
        wait_for("worker 2 registered again",  # the others at the barrier
                 lambda: obs.stats(*addresses)[addresses[0]]["evicted_workers"] == [], timeout=60)
        for w in workers[:2]:
            w.send("until", version=8)
        end = [w.ok() for w in workers]
        assert [e["versions"] for e in end] == [[8]] * 3
        # worker 2 missed rounds 3..5 and goes on from its own clock: 5 steps of 8; the step it tried first
        # after the heal was refused and its gradient dropped at the rejoin
        assert [(e["rejoins"], e["pushes"], e["clock"]) for e in end] == [(0, 8, 8), (0, 8, 8), (1, 5, 5)]
        digests = {w.ask("weights")["digest"] for w in workers}
        assert digests == {obs.ask("server_weights", addresses=addresses)["digest"]}
        s = obs.stats(*addresses)[addresses[0]]
        assert (s["evictions_total"], s["version"], s["gradients_applied_total"]) == (1, 8, 3 * 2 + 2 * 3 + 3 * 3)


# ---- 2. a server host cut mid-push, then healed ----------------------------------------------------------------

@needs_netns
@pytest.mark.timeout(180)
def test_a_server_cut_mid_push_then_healed_the_push_completes_and_the_result_is_exact():
    """bsp, SGD, 2 shards on h0 and h1, 2 workers. h1's link goes down after 3 steps, and the 4th begins: both
    workers' pushes to shard 0 are taken in (its version moves) while their pushes to shard 1 cannot arrive.
    Healed, the same pushes complete (TCP delivers what it held back: nothing is retried, nothing fails over)
    and the final weights equal those of a run without the cut, bit for bit. Cut for longer than the workers'
    RPC deadline (3 s here, shorter than the channels' keepalive: the next test), the step fails instead:
    DEADLINE_EXCEEDED, which nobody retries. The lease is long (60 s): the cut lasts until the test has seen
    shard 0's version move, which a loaded machine may take longer than LEASE for, and an eviction is not
    what this test is about (the first test's)."""
    steps, at = 6, 3
    with NetCluster(4, "1gbit") as net:
        procs = [server(net, h, "--shard-index", str(i), "--num-shards", "2", "--lease-seconds", "60", port=port)
                 for port in (REF_PORT, PORT) for i, h in enumerate(("h0", "h1"))]
        obs, *workers = drivers(net, ["h0", "h2", "h3"])
        ready = [read_ready(p, 60).split()[0] for p in procs]
        ref, addresses = ready[:2], ready[2:]

        def join(addresses: list[str]) -> None:
            for k, w in enumerate(workers):
                w.send("join", addresses=addresses, worker=k, workers=2)
            for w in workers:
                w.ok()

        join(ref)  # the run without a fault, on servers of its own
        each(workers, "steps", n=steps)
        expected = [w.ask("weights")["digest"] for w in workers]

        join(addresses)
        each(workers, "steps", n=at)
        net.cut("h1")
        for w in workers:
            w.send("steps", n=1)
        wait_for("shard 0 took step 3 of both", lambda: obs.stats(addresses[0])[addresses[0]]["version"] == at + 1)
        assert not any(w.answered for w in workers)  # waiting for shard 1
        net.heal("h1")
        mid = [w.ok() for w in workers]
        assert [(m["versions"], m["retries"], m["failovers"]) for m in mid] == [([at + 1] * 2, 0, 0)] * 2
        each(workers, "steps", n=steps - at - 1)
        assert [w.ask("weights")["digest"] for w in workers] == expected
        for s in obs.stats(*addresses).values():
            assert s["version"] == steps and s["gradients_applied_total"] == 2 * steps
            assert s["duplicate_pushes_total"] == 0 and s["evictions_total"] == 0

        each(workers, "timeout", seconds=3.0)
        net.cut("h1")
        for w in workers:
            w.send("steps", n=1)
        failed = [w.answer(30) for w in workers]
        assert obs.stats(addresses[0])[addresses[0]]["version"] == steps + 1  # shard 0 took the step
        net.heal("h1")
        for f in failed:
            assert not f["ok"] and "ShardError: shard 1" in f["error"] and "DEADLINE_EXCEEDED" in f["error"], f
        for st in each(workers, "state"):
            assert (st["clock"], st["retries"], st["failovers"]) == (steps, 0, 0)  # the step is not taken


@needs_netns
@pytest.mark.timeout(120)
def test_a_link_gone_silent_under_a_waiting_call_is_unavailable_after_the_keepalive_not_the_deadline():
    """bsp, 2 workers, one shard on h0. Worker 0 has pushed its 2nd step and waits for worker 1's when h0's
    link goes down: no reset, no FIN, nothing arrives. Its channel pings after SHARDPS_KEEPALIVE_S (1 s here)
    and gives the connection up when no answer came within half of that, so the waiting call fails UNAVAILABLE
    (Unreachable: recovery_timeout 0) and not at its 60 s deadline; without the pings only the deadline would
    end it. Healed, worker 1's push completes the round with worker 0's (the shard kept it)."""
    with NetCluster(3, "1gbit") as net:
        srv = server(net, "h0", "--lease-seconds", "60")
        workers = drivers(net, ["h1", "h2"], env={**os.environ, "SHARDPS_KEEPALIVE_S": "1"})
        [address] = read_ready(srv, 60).split()[:1]
        for k, w in enumerate(workers):
            w.send("join", addresses=[address], worker=k, workers=2, timeout=60.0, recovery=30.0 * k)
        for w in workers:
            w.ok()
        each(workers, "steps", n=1)
        clocks = workers[1].stats(address)[address]["worker_clocks"]
        workers[0].send("steps", n=1)
        wait_for("worker 0's push of step 2 taken in",
                 lambda: workers[1].stats(address)[address]["worker_clocks"] != clocks)
        net.cut("h0")
        cut = time.monotonic()
        failed = workers[0].answer(60)
        took = time.monotonic() - cut
        print(f"the waiting call failed {took:.1f}s after the cut")
        assert not failed["ok"] and "Unreachable" in failed["error"] and "UNAVAILABLE" in failed["error"], failed
        assert "DEADLINE_EXCEEDED" not in failed["error"], failed
        net.heal("h0")
        assert workers[1].ask("steps", n=1)["versions"] == [2]


# ---- 3. replicas 2: a primary cut off from its backup and from the workers --------------------------------------

@needs_netns
@pytest.mark.timeout(240)
def test_a_primary_partitioned_from_its_backup_and_the_workers_makes_two_primaries():
    """--replicas 2, 3 workers under bsp. Shard 0 (h0) has its backup on h1 and stays reachable from every host;
    shard 1's primary is on h1, its backup a spare on h4 (--backup-only 1), so that a partition can put the
    primary and its backup on different sides: {h1 (primary 1), h5 (worker 2)} | {h2, h3 (workers 0, 1),
    h4 (backup 1)}, both processes up.

    What happens: workers 0 and 1, restarted (between steps: no call of theirs waits on h1), cannot connect to h1
    and ask the backup to take over, which it does, since it cannot reach h1 either (Peers.Describe). From then on
    two primaries of shard 1 acknowledge writes: the old one, alone (degraded, after --replica-timeout), worker 2's;
    the new one, workers 0's and 1's. Each applies the same 3 rounds with different gradients, and worker 2's 3
    acknowledged gradients on the old primary are lost. Healed, the old primary is fenced (deposed) only once its
    replication connection to h4 carries again; worker 2 then fails over, is refused as evicted and registers again,
    going on from its newest clock (shard 0's; the new primary skips it there), and the job goes on."""
    hosts = ["h0", "h1", "h2", "h3", "h4", "h5"]
    # Each RPC's deadline 60 s: a bsp step waits for the other side's workers, and on a loaded machine (the
    # suite's last minutes, a Ray cluster starting beside it) a round was seen to take over 28 s.
    rounds = 3
    with NetCluster(hosts, "1gbit") as net:
        a = {h: f"{net.host(h)}:{PORT}" for h in hosts}
        r = {h: f"{net.host(h)}:{REPLICA_PORT}" for h in hosts}
        common = ("--num-shards", "2", "--replica-port", str(REPLICA_PORT), "--replica-timeout", "2")
        procs = [server(net, "h0", "--shard-index", "0", "--replicas", "2", "--replica-target", r["h1"], *common),
                 server(net, "h1", "--shard-index", "1", "--replicas", "2", "--replica-target", r["h4"], *common),
                 server(net, "h4", "--backup-only", "1", *common)]
        obs, old_side, *workers = drivers(net, ["h4", "h1", "h2", "h3", "h5"])
        for p in procs:
            read_ready(p, 60)
        old, new = a["h1"], r["h4"]  # shard 1's primary, and its backup (the new primary once it took over)
        addresses, backups = [a["h0"], old], [r["h1"], new]
        wait_for("both backups in sync",
                 lambda: all(s.get("replica_state") == "synced" for s in obs.stats(*addresses).values()))
        for k, w in enumerate(workers):
            w.send("join", addresses=addresses, worker=k, workers=3, backups=backups, timeout=60.0)
        for w in workers:
            w.ok()
        each(workers, "steps", n=2)

        net.partition({"h1", "h5"}, {"h2", "h3", "h4"})
        for k in (0, 1):  # restarted: they cannot connect to h1 and ask its backup to take over
            workers[k].send("join", addresses=addresses, worker=k, workers=3, backups=backups, timeout=60.0)
        moved = [workers[k].ok() for k in (0, 1)]
        assert [(m["failovers"], m["addresses"][1]) for m in moved] == [(1, new)] * 2
        wait_for("the old primary evicted workers 0 and 1",
                 lambda: old_side.stats(old)[old]["evicted_workers"] == [0, 1])
        both = {**obs.stats(new), **old_side.stats(old)}
        assert (both[old]["role"], both[new]["role"]) == ("primary", "primary")  # two primaries of shard 1

        done = each(workers, "steps", n=rounds)
        assert [(d["versions"], d["addresses"][1]) for d in done] == [([2 + rounds] * 2, new)] * 2 + \
            [([2 + rounds] * 2, old)]  # worker 2's steps were acknowledged by the old primary
        s = {**obs.stats(a["h0"], new), **old_side.stats(old)}
        assert s[a["h0"]]["version"] == 2 + rounds and s[a["h0"]]["worker_clocks"] == {k: 1 + rounds for k in range(3)}
        assert (s[old]["role"], s[old]["replica_state"], s[old]["version"]) == ("primary", "degraded", 2 + rounds)
        assert (s[new]["role"], s[new]["version"]) == ("primary", 2 + rounds)
        # the same rounds 3..5 on both primaries: worker 2's gradients alone on the old one, workers 0's and 1's
        # on the new one, which never got worker 2's acknowledged steps 2..4
        assert s[old]["worker_clocks"] == {0: 1, 1: 1, 2: 1 + rounds}
        assert s[old]["gradients_applied_total"] == 3 * 2 + rounds
        assert s[new]["worker_clocks"] == {0: 1 + rounds, 1: 1 + rounds, 2: 1}
        assert s[new]["gradients_applied_total"] == 3 * 2 + 2 * rounds

        net.partition()
        healed = time.monotonic()
        wait_for("the old primary deposed", lambda: old_side.stats(old)[old]["role"] == "deposed", timeout=150)
        print(f"the old primary was deposed {time.monotonic() - healed:.1f}s after the heal")

        # The rejoin goes on: worker 2 comes back with its newest clock (shard 0's), and shard 1, which evicted it,
        # skips it there (RegisterResponse.skips). It used to go on from the lowest: shard 0 then answered its
        # pushes as duplicates, counted in no round, and every worker's step ended in DEADLINE_EXCEEDED.
        each(workers, "timeout", seconds=5.0)
        for w in workers:
            w.send("until", version=2 + rounds + 4)
        went_on = [w.answer(60) for w in workers]
        assert [x.get("versions") for x in went_on[:2]] == [[2 + rounds + 4] * 2] * 2, went_on
        # worker 2's rejoining step reached shard 0 only (shard 1 had evicted it): its last push waits, at most, for
        # a round that workers 0 and 1, stopped at the version asked, no longer push
        assert went_on[2]["ok"] or ("DEADLINE_EXCEEDED" in went_on[2]["error"]
                                    and "missing [0, 1]" in went_on[2]["error"]), went_on[2]
        w2 = workers[2].ask("state")
        assert (w2["rejoins"], w2["failovers"], w2["addresses"][1]) == (1, 1, new)
        assert w2["clock"] >= 2 + rounds + 4  # from its newest clock, not the lowest
