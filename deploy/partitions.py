"""The partition harness: faults of the network and of processes against a job under ``--coordinator``, and
a checker of what was acknowledged (docs/operations.md, "Partitions, checked").

    python -m shardps.deploy.partitions                      # every nemesis, 20 runs each (make partition)
    python -m shardps.deploy.partitions --nemesis pause --runs 3

A simulated cluster (``shardps.netsim``) of nine hosts: etcd (``e0``), two
shards whose primaries (``s0``, ``s1``) each replicate to a spare backup
(``b0``, ``b1``, ``--backup-only``), three asp workers (``w0``..``w2``) and
an observer (``ob``) that no partition cuts. Each run is a new job (its own
keys in etcd, fresh servers) in three phases, each a number of pushes, so a
fault starts and ends between two given pushes, never at a moment:

1. ``before`` pushes acknowledged by every worker, the cluster whole;
2. the nemesis starts; each worker makes ``during`` attempts (acknowledged,
   refused or timed out: the client retries and fails over as it would);
3. the nemesis ends; each worker goes on until ``before + during + after`` of
   its pushes are acknowledged ("the job goes on"), within a deadline.

Then the observer reads, from etcd, who serves each shard, and from those
servers the weights; deploy/partitioncheck.py checks them against every
worker's log (exact accounting: each push adds 1.0 to a coordinate of its
own) and the acknowledgements (one server a version, epochs that only rise).

The nemeses (``NEMESES``) are seven; what each does to shard 1,
and what the checker expects of it, is in its line there. Needs root (network
namespaces) and Debian's ``etcd`` (``make tools``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardps.deploy.local import read_ready
from shardps.deploy.netsim import NetCluster, unavailable
from shardps.deploy.partitioncheck import Tally, check
from shardps.server.coordinator import etcd_argv

PORT, REPLICA_PORT, ETCD_PORT = 7000, 7100, 2379  # each host has its own address: fixed ports do
HOSTS = ["e0", "s0", "s1", "b0", "b1", "w0", "w1", "w2", "ob"]
WORKERS = ["w0", "w1", "w2"]
TTL = 2  # --coordinator-ttl: a primary cut off stops acknowledging within it, a backup takes over after it
LEASE = 2.0  # --lease-seconds: a worker cut off this long is evicted (it rejoins after the heal)
RPC_TIMEOUT, RECOVERY = 10.0, 6.0  # a worker's deadline a call, and how long it retries and fails over a shard
# A channel pings after 1 s of silence (SHARDPS_KEEPALIVE_S): a call on a link that went silent fails UNAVAILABLE,
# and fails over, within 1.5 s, not at its deadline (docs/operations.md).
ENV = {"SHARDPS_KEEPALIVE_S": "1"}
ANSWER = 120.0  # how long the harness waits for any one answer of a worker before it calls the run stuck


class HarnessError(RuntimeError):
    """The harness could not run (no namespaces, no etcd) or a run could not be set up."""


class Stuck(RuntimeError):
    """A process did not answer within its deadline: the run did not go on."""


class Proc:
    """deploy/partitionworker.py in a host: a JSON command a line in, a JSON answer a line out."""

    def __init__(self, net: NetCluster, host: str) -> None:
        self.host = host
        self.proc = net.start(host, [sys.executable, "-m", "shardps.deploy.partitionworker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, **ENV})
        self.lines: queue.Queue[str] = queue.Queue()
        self.last = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        self.last = op

    def answer(self, timeout: float = ANSWER) -> dict[str, Any]:
        try:
            got: dict[str, Any] = json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise Stuck(f"{self.host}: no answer to {self.last!r} within {timeout:g}s "
                        f"(exit code {self.proc.poll()})") from None
        if not got.get("ok"):
            raise HarnessError(f"{self.host}: {self.last}: {got.get('trace') or got.get('error')}")
        return got

    def ask(self, op: str, timeout: float = ANSWER, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.answer(timeout)


def each(procs: list[Proc], op: str, timeout: float = ANSWER, **args: Any) -> list[dict[str, Any]]:
    """``op`` sent to every process at once; their answers, in order."""
    for p in procs:
        p.send(op, **args)
    return [p.answer(timeout) for p in procs]


@dataclass(frozen=True)
class Nemesis:
    name: str
    what: str  # what it does, one line (docs/operations.md's table)
    start: Callable[[Harness], None]
    stop: Callable[[Harness], None]
    # whether the fault took effect, asked after each round of the fault's pushes (each worker's answers)
    took_effect: Callable[[Harness, list[dict[str, Any]]], bool]
    effect: str  # what took_effect waits for, in words


def _partition(*groups: set[str]) -> Callable[[Harness], None]:
    return lambda h: h.net.partition(*groups)


def _heal(h: Harness) -> None:
    h.net.partition()


def _cut(host: str) -> Callable[[Harness], None]:
    def cut(h: Harness) -> None:
        h.net.cut(host)
    return cut


def _uncut(host: str) -> Callable[[Harness], None]:
    def heal(h: Harness) -> None:
        h.net.heal(host)
    return heal


def _stop_etcd(h: Harness) -> None:
    h.stop_etcd()


def _start_etcd(h: Harness) -> None:
    h.start_etcd()


def _signal(host: str, sig: signal.Signals) -> Callable[[Harness], None]:
    return lambda h: os.killpg(h.servers[host].pid, sig)


def _taken_over(h: Harness, _: list[dict[str, Any]]) -> bool:
    return h.records()[1]["primary"] == h.address("b1")


def _both_alone(h: Harness, _: list[dict[str, Any]]) -> bool:
    return all(r["alone"] for r in h.records())


def _nothing_acknowledged(h: Harness, answers: list[dict[str, Any]]) -> bool:
    return all(a["pushed"] == 0 for a in answers)


TAKEOVER = "shard 1's backup took over (etcd names it, epoch 2)"
NEMESES = {n.name: n for n in [
    Nemesis("primary-cut", "shard 1's primary and worker 2 | its backup, workers 0 and 1, etcd",
            _partition({"s1", "w2"}, {"b1", "w0", "w1", "e0"}), _heal, _taken_over, TAKEOVER),
    Nemesis("halves", "s0, b1, w0, etcd | s1, b0, w1, w2: each shard's primary and backup apart",
            _partition({"s0", "b1", "w0", "e0"}, {"s1", "b0", "w1", "w2"}), _heal, _taken_over, TAKEOVER),
    Nemesis("isolate", "shard 1's primary's link down",
            _cut("s1"), _uncut("s1"), _taken_over, TAKEOVER),
    Nemesis("bridge", "both primaries and w0 | both backups, w1 and w2; etcd sees both sides",
            _partition({"s0", "s1", "w0"}, {"b0", "b1", "w1", "w2"}), _heal, _both_alone,
            "both primaries went on alone (etcd records it)"),
    Nemesis("pause", "shard 1's primary stopped (SIGSTOP) until its backup took over, then resumed",
            _signal("s1", signal.SIGSTOP), _signal("s1", signal.SIGCONT), _taken_over, TAKEOVER),
    Nemesis("etcd-cut", "shard 1's primary | etcd; everything else whole",
            _partition({"s1"}, {"e0"}), _heal, _taken_over, TAKEOVER),
    Nemesis("etcd-restart", "etcd killed (SIGKILL), then started again on its data",
            _stop_etcd, _start_etcd, _nothing_acknowledged,
            "a round of pushes with none acknowledged (no primary holds a lease)"),
]}


@dataclass
class RunResult:
    nemesis: str
    index: int
    tally: Tally | None = None
    went_on: bool = False
    takeovers: list[int] = field(default_factory=list)  # each shard's epoch at the end, less one
    during: list[int] = field(default_factory=list)  # each worker's pushes acknowledged during the fault
    rounds: int = 0  # rounds of pushes until the fault took effect (0: it did not)
    seconds: float = 0.0
    error: str = ""
    logs: str = ""  # where the run's server logs are kept (a failed run's only)

    @property
    def ok(self) -> bool:
        return (self.went_on and self.rounds > 0 and self.tally is not None and not self.tally.violations
                and not self.error)

    def line(self) -> str:
        t = self.tally
        if t is None:
            return f"{self.nemesis} #{self.index}: FAILED ({self.seconds:.0f}s): {self.error}"
        verdict = "ok" if self.ok else "FAILED"
        return (f"{self.nemesis} #{self.index}: {verdict} ({self.seconds:.0f}s): {t.acked} acknowledged, "
                f"{t.dropped + t.pending} unknown ({t.unknown_applied} applied), {t.lost} lost, {t.doubled} doubled,"
                f" {t.split} split versions; took effect after {self.rounds} rounds; during the fault {self.during} "
                f"acknowledged; takeovers {self.takeovers};"
                f" went on: {self.went_on}" + (f"; {self.error}" if self.error else "")
                + "".join(f"\n    {v}" for v in t.violations[:10]))


class Harness:
    """The cluster (``up``), then ``run(nemesis, index)`` as often as asked, then ``close``."""

    def __init__(self, before: int = 2, during: int = 2, after: int = 2, keep_logs: str | None = None,
                 effect_timeout: float = 90.0) -> None:
        self.before, self.during, self.after, self.effect_timeout = before, during, after, effect_timeout
        self.per_worker = 2000  # room for every round until the fault took effect, and for pushes dropped at rejoins
        self.job = ""
        self.net = NetCluster(HOSTS, "1gbit")
        self.data = tempfile.mkdtemp(prefix="shardps-partitions-")
        self.keep_logs = keep_logs
        self.etcd: subprocess.Popen[str] | None = None
        self.servers: dict[str, subprocess.Popen[str]] = {}
        self.workers: list[Proc] = []
        self.observer: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.net.host('e0')}:{ETCD_PORT}"

    def address(self, host: str) -> str:
        return f"{self.net.host(host)}:{REPLICA_PORT if host.startswith('b') else PORT}"

    def up(self) -> Harness:
        reason = unavailable()
        if reason is not None:
            raise HarnessError(reason)
        if shutil.which("etcd") is None:
            raise HarnessError("etcd is not installed (Debian's etcd-server: `make tools`)")
        self.net.up()
        self.start_etcd()
        procs = [Proc(self.net, h) for h in [*WORKERS, "ob"]]
        for p in procs:
            p.answer()
        self.workers, self.observer = procs[:-1], procs[-1]
        self.observer.ask("record", endpoints=[self.endpoint], job="up", shards=1, wait=30.0)
        return self

    def close(self) -> None:
        self.net.close()
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> Harness:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- etcd ------------------------------------------------------------------------------------------------
    def start_etcd(self) -> None:
        host = self.net.host("e0")
        argv = etcd_argv("etcd", os.path.join(self.data, "etcd"), host, ETCD_PORT, ETCD_PORT + 1)
        self.etcd = self.net.start("e0", argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.observer is not None:  # up() waits for it through the observer it starts next
            self.observer.ask("record", endpoints=[self.endpoint], job="up", shards=1, wait=30.0)

    def stop_etcd(self) -> None:
        p, self.etcd = self.etcd, None
        if p is not None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)

    # ---- one run ---------------------------------------------------------------------------------------------
    def _start_servers(self, job: str, logdir: Path) -> None:
        common = ["--num-shards", "2", "--replica-port", str(REPLICA_PORT), "--replica-timeout", "2",
                  "--coordinator", f"etcd://{self.endpoint}", "--coordinator-ttl", str(TTL), "--job", job,
                  "--lease-seconds", str(LEASE)]
        args = {"s0": ["--shard-index", "0", "--replicas", "2", "--replica-target", self.address("b0")],
                "s1": ["--shard-index", "1", "--replicas", "2", "--replica-target", self.address("b1")],
                "b0": ["--backup-only", "0"], "b1": ["--backup-only", "1"]}
        for h, a in args.items():
            with open(logdir / f"{h}.log", "w") as log:
                self.servers[h] = self.net.start(h, [sys.executable, "-m", "shardps", "server", "--host",
                                                     self.net.host(h), "--port", str(PORT), *a, *common],
                                                 stdout=subprocess.PIPE, stderr=log, env={**os.environ, **ENV})
        for h, p in self.servers.items():
            try:
                read_ready(p, 120)
            except Exception as e:  # noqa: BLE001 - the run could not be set up: say which server
                raise HarnessError(f"server {h} did not start: {e}") from None

    def _stop_servers(self) -> None:
        for p in self.servers.values():
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    os.killpg(p.pid, sig)
        for p in self.servers.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(15)
        self.servers = {}

    def _wait_synced(self, timeout: float = 60.0) -> None:
        assert self.observer is not None
        deadline = time.monotonic() + timeout
        addresses = [self.address("s0"), self.address("s1")]
        while True:  # another process's state: nothing to wait on but its answers
            got = self.observer.ask("stats", addresses=addresses)["stats"]
            if all(s.get("replica_state") == "synced" for s in got.values()):
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"the backups were not in sync within {timeout:g}s: {got}")
            time.sleep(0.2)

    def run(self, nemesis: Nemesis, index: int) -> RunResult:
        result = RunResult(nemesis.name, index)
        t0 = time.monotonic()
        job = self.job = f"{nemesis.name}-{index}-{uuid.uuid4().hex[:6]}"
        logdir = Path(self.data) / job
        logdir.mkdir()
        try:
            self._start_servers(job, logdir)
            self._wait_synced()
            result.tally = self._run(nemesis, result, job)
        except Exception as e:  # noqa: BLE001 - the run failed, said in its line; the campaign goes on
            result.error = str(e) if isinstance(e, (HarnessError, Stuck)) else f"{type(e).__name__}: {e}"
        finally:
            if self.etcd is None:  # the nemesis stopped it and the run ended before it came back
                self.start_etcd()
            self._stop_servers()
            self.net.partition()
            result.seconds = time.monotonic() - t0
            if self.keep_logs:
                kept = Path(self.keep_logs) / job
                shutil.copytree(logdir, kept)
                result.logs = str(kept)
            shutil.rmtree(logdir, ignore_errors=True)
        return result

    def records(self) -> list[dict[str, Any]]:
        """Each shard's record in etcd (primary, epoch, alone, held), as the observer reads it."""
        assert self.observer is not None
        got: list[dict[str, Any]] = self.observer.ask("record", endpoints=[self.endpoint], job=self.job, shards=2,
                                                      timeout=10.0)["records"]
        if any(r is None for r in got):
            raise HarnessError(f"a shard of job {self.job} has no record in etcd: {got}")
        return got

    def _run(self, nemesis: Nemesis, result: RunResult, job: str) -> Tally:
        assert self.observer is not None
        addresses, backups = [self.address("s0"), self.address("s1")], [self.address("b0"), self.address("b1")]
        for k, w in enumerate(self.workers):
            w.send("join", addresses=addresses, backups=backups, worker=k, workers=len(self.workers),
                   per_worker=self.per_worker, timeout=RPC_TIMEOUT, recovery=RECOVERY)
        joined = [w.answer() for w in self.workers]
        parts = joined[0]["parts"]
        first = each(self.workers, "push", acked=self.before, attempts=self.before)
        if any(f["acked"] < self.before for f in first):
            raise HarnessError(f"before the fault, not every push was acknowledged: {first}")
        nemesis.start(self)
        try:
            # one attempt a worker a round, until the fault took effect (a state, asked after each round, within
            # a deadline), then `during` rounds more
            deadline = time.monotonic() + self.effect_timeout
            for n in itertools.count(1):
                answers = each(self.workers, "push", acked=self.per_worker, attempts=1)
                if nemesis.took_effect(self, answers):
                    result.rounds = n
                    break
                if time.monotonic() > deadline:
                    result.error = (f"the fault did not take effect ({nemesis.effect}) within "
                                    f"{self.effect_timeout:g}s ({n} rounds)")
                    break
            answers = each(self.workers, "push", acked=self.per_worker, attempts=self.during)
            result.during = [a["acked"] - f["acked"] for a, f in zip(answers, first, strict=True)]
        finally:
            nemesis.stop(self)
        goal = max(a["acked"] for a in answers) + self.after
        try:
            end = each(self.workers, "push", timeout=3 * ANSWER, acked=goal, attempts=goal + 30)
            result.went_on = all(e["acked"] >= goal for e in end)
            if not result.went_on:
                result.error = f"the job did not go on: {[e['acked'] for e in end]} of {goal} acknowledged"
        except Stuck as e:
            result.error = f"the job did not go on: {e}"
        records = self.records()
        result.takeovers = [r["epoch"] - 1 for r in records]
        weights = self.observer.ask("weights", addresses=[r["primary"] for r in records])["weights"]
        logs = [w.ask("log")["pushes"] for w in self.workers]
        return check(logs, parts, weights, self.per_worker)


def table(results: list[RunResult]) -> str:
    """docs/operations.md's table: one line a nemesis."""
    rows = ["| nemesis | runs | acknowledged | unknown (applied) | lost | applied twice | split versions | "
            "went on | takeovers | acknowledged during the fault | seconds a run |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r.nemesis for r in results):
        rs = [r for r in results if r.nemesis == name]
        ts = [r.tally for r in rs if r.tally is not None]
        unknown = sum(t.dropped + t.pending for t in ts)
        rows.append(
            f"| {name} | {len(rs)} | {sum(t.acked for t in ts)} | {unknown} ({sum(t.unknown_applied for t in ts)}) | "
            f"{sum(t.lost for t in ts)} | {sum(t.doubled for t in ts)} | {sum(t.split for t in ts)} | "
            f"{sum(r.went_on for r in rs)}/{len(rs)} | {sum(sum(r.takeovers) for r in rs)} | "
            f"{sum(sum(r.during) for r in rs)} | {sum(r.seconds for r in rs) / len(rs):.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardps.deploy.partitions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nemesis", nargs="+", choices=sorted(NEMESES), default=list(NEMESES),
                    help="which faults (default: all seven)")
    ap.add_argument("--runs", type=int, default=20, help="runs of each nemesis (default 20)")
    ap.add_argument("--before", type=int, default=2, help="pushes a worker makes before the fault")
    ap.add_argument("--during", type=int, default=2,
                    help="attempts a worker makes during the fault once it took effect")
    ap.add_argument("--effect-timeout", type=float, default=90.0,
                    help="seconds the fault has to take effect (default 90)")
    ap.add_argument("--after", type=int, default=2, help="pushes a worker goes on with after the heal")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy each run's server logs here")
    ap.add_argument("--json", metavar="FILE", help="write every run's result here")
    a = ap.parse_args(argv)
    results: list[RunResult] = []
    try:
        with Harness(a.before, a.during, a.after, a.keep_logs, a.effect_timeout) as h:
            for name in a.nemesis:
                for i in range(a.runs):
                    r = h.run(NEMESES[name], i)
                    results.append(r)
                    print(r.line(), flush=True)
    except HarnessError as e:
        print(f"partitions: {e}", file=sys.stderr)
        return 2
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps([{**{k: v for k, v in vars(r).items() if k != "tally"},
                                             "tally": None if r.tally is None else vars(r.tally)}
                                            for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
