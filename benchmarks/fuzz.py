#!/usr/bin/env python
"""Fuzz a live shardps job with 10,000+ malformed and random requests.

The generators and the rules are shardps/testing/fuzz/'s (tests/test_fuzz.py
runs ~450 of the same cases under hypothesis): random and damaged Push,
Register, Pull, PullState, Exchange, SetSync, Stats, Heartbeat, Rollback,
Checkpoint and the replication RPCs (Replicate, Promote, AttachReplica)
sent to primaries, and raw
bytes that may not be protobuf at all, sent one at a time to a job of
``--workers`` registered workers that have pushed ``--steps`` valid steps
each. Every Push, and every Register that could create a tensor, carries at
least one deliberate defect, so no case may change the shards' state.

Reported: cases sent, answers per status code and per kind of case, the
known bugs hit (fuzz.KNOWN_BUGS) and any violation (a status outside
fuzz.REFUSALS such as UNKNOWN or INTERNAL that no known bug explains, a
success where a refusal was due, an exception the server logged, a state
change), whether the servers still serve, whether their state is unchanged
and a valid pull gives the weights of before, and the elapsed time.

Then ``--frames`` (default: as many as ``--cases``) damaged frames on the
servers' data connection (shardps/testing/fuzz/gen_frames.py: raw bytes, frames
torn at any byte, extents reordered, past their buffer or short of their
part, lengths that disagree, unknown kinds and routes, another worker's
requests, streams cut short or going on after their end, a connection
closed mid-frame), each on a connection of its own after worker 0's hello
(the setup's worker 0 is on the data connection): every answer a refusal,
the state unchanged (checked after each in process).

A generator that raises while drawing a case (fuzz.draw_case) is a
generator defect: reported with the seed, the case number, the exception and
the generator's line; that case is not sent and the campaign goes on.

State checks: with in-process servers (the default) after every case; with
``--processes`` (each shard its own ``shardps server``) from the outside,
every ``--check-every`` cases. A state change is reported with the case (and
the one before it, whose stream the server may still have been handling),
then the fuzzer re-reads the shards' state and goes on.

fuzz.KNOWN_BUGS lists every bug this fuzzer has found (all fixed at the
time of writing). An answer that matches an open one is counted as that bug;
one that matches a fixed one is a regression, a violation.
``--avoid-known-bugs`` keeps the generators away from the open ones (as the
test does).

Exit status: 0 clean; 2 open known bugs hit, nothing else; 1 a violation, a
generator defect, a server down or state changed by something no open bug
explains.

    .venv/bin/python benchmarks/fuzz.py --cases 10000 [--seed 0] [--processes] [--shards 2 --sync bsp]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import grpc
from guard import cluster_processes, run_guarded

import shardps
from shardps.testing import fuzz
from shardps.testing.fuzz import gen_frames

_CLUSTERS: list[shardps.LocalCluster] = []  # for the watchdog's last resort


def _log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    codes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    codes_by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    verdicts: collections.Counter[str] = collections.Counter()
    known: collections.Counter[str] = collections.Counter()
    known_examples: dict[str, str] = {}
    violations: list[dict[str, Any]] = []
    state_changes: list[dict[str, Any]] = []
    n_violations = 0
    generator_defects: list[dict[str, Any]] = []
    seconds_by_kind: collections.Counter[str] = collections.Counter()

    def violation(i: int, reason: str, case: fuzz.Case | None) -> None:
        nonlocal n_violations
        n_violations += 1
        if len(violations) < args.keep:
            violations.append({"case": i, "reason": reason, "request": repr(case)[:3000] if case else None})
        _log(args, f"VIOLATION at case {i}: {reason}")

    # No leases: the setup's workers sit idle during the run and would be evicted (a change of state).
    cluster = shardps.LocalCluster(args.shards, processes=args.processes, startup_timeout=args.startup_timeout,
                                   lease_s=0, replicas=args.replicas)
    _CLUSTERS.append(cluster)
    server_log = None
    stack = contextlib.ExitStack()
    stack.callback(cluster.stop)
    if args.processes:  # the servers' stderr (gRPC logs a failing handler's traceback there) goes to a file
        server_log = tempfile.NamedTemporaryFile("w+", prefix="shardps-fuzz-servers-", suffix=".log", delete=False)
        saved = os.dup(2)
        os.dup2(server_log.fileno(), 2)
        try:
            cluster.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    else:
        cluster.start()
    with stack, fuzz.capture_server_errors() as errors, \
            fuzz.Fuzzer(cluster.addresses, cluster.backup_addresses) as fz:
        _log(args, f"fuzz.py: {args.shards} shard(s) {'as processes' if args.processes else 'in process'}, "
                   f"sync {args.sync}, {args.workers} workers; {args.cases} cases, seed {args.seed}")
        conn: dict[str, Any] = {}
        weights = fuzz.prepare_job(cluster.addresses, args.sync, num_workers=args.workers, steps=args.steps,
                                      timeout=args.rpc_timeout, frames=conn)
        target = fz.describe()
        first_fp = baseline_fp = fz.fingerprint(args.rpc_timeout)
        stores = cluster.stores + cluster.backups  # in process: the backups' state is checked too
        local = fuzz.local_state(stores) if stores else None
        src = fuzz.RandomSource(random.Random(args.seed))
        prev: fuzz.Case | None = None
        checked_at = 0
        t0 = time.monotonic()

        def state_changed(i: int, case: fuzz.Case, suspects: list[fuzz.Case | None], since: int,
                          case_succeeded: bool = False) -> None:
            """The state moved at case ``i`` (or since case ``since``). Blamed on a malformed stream among
            ``suspects`` (the bug malformed-stream-prefix-applied) only when case ``i`` itself was not a
            request that should have been refused and succeeded: that one changed it."""
            nonlocal target, baseline_fp, local
            culprits = [] if case_succeeded else \
                [c for c in suspects if c is not None and c.malformed and c.method in fuzz.CLIENT_STREAM]
            bug = "malformed-stream-prefix-applied" if culprits else None
            entry = {"case": i, "since_case": since, "known_bug": bug if bug and fuzz.KNOWN_BUGS[bug].open else None,
                     "request": repr(culprits[-1] if culprits else case)[:3000]}
            state_changes.append(entry)
            if bug and fuzz.KNOWN_BUGS[bug].open:
                known[bug] += 1
                known_examples.setdefault(bug, entry["request"])
                _log(args, f"state changed at case {i}: known bug {bug}")
            elif bug:
                violation(i, f"fixed bug {bug} is back: the shards' state changed after a malformed stream",
                          culprits[-1])
            else:
                where = f"at case {i}" if since == i else f"between cases {since} and {i} (checked every --check-every)"
                violation(i, f"the shards' state changed {where}", case if since == i else None)
            time.sleep(0.05)  # let a still-running handler finish before the state is read again
            target = fz.describe()
            baseline_fp = fz.fingerprint(args.rpc_timeout)
            local = fuzz.local_state(stores) if stores else None

        for i in range(1, args.cases + 1):
            drawn = fuzz.draw_case(src, target, avoid_known_bugs=args.avoid_known_bugs)
            if isinstance(drawn, fuzz.GeneratorDefect):  # nothing to send: report it and go on
                generator_defects.append({"seed": args.seed, "case": i, "error": drawn.error, "where": drawn.where})
                _log(args, f"GENERATOR DEFECT at case {i} (seed {args.seed}): {drawn.error} ({drawn.where})")
                continue
            case = drawn
            mark = len(errors.records)
            out = fz.send(case)
            v = fuzz.judge(case, out, errors.since(mark) if cluster.stores else ())
            codes[out.code] += 1
            kinds[case.kind] += 1
            codes_by_kind[case.kind][out.code] += 1
            seconds_by_kind[case.kind] += out.seconds
            verdicts[v.kind] += 1
            if v.kind == "known" and v.bug is not None:
                known[v.bug] += 1
                known_examples.setdefault(v.bug, repr(case)[:3000])
            elif v.kind == "violation":
                violation(i, v.reason, case)
            if stores:
                if fuzz.local_state(stores) != local:
                    state_changed(i, case, [prev, case], i, case_succeeded=out.code == "OK" and not case.may_succeed)
            elif i - checked_at >= args.check_every or i == args.cases:
                if fz.fingerprint(args.rpc_timeout) != baseline_fp:
                    state_changed(i, case, [], checked_at + 1)
                checked_at = i
            prev = case
            if i % args.progress_every == 0 or i == args.cases:
                el = time.monotonic() - t0
                top = ", ".join(f"{k} {n}" for k, n in codes.most_common())
                _log(args, f"[{i}/{args.cases}] {el:.1f}s ({i / el:.0f} cases/s): {top}; "
                           f"violations {n_violations}, known bugs {sum(known.values())}, "
                           f"generator defects {len(generator_defects)}")
        elapsed = time.monotonic() - t0
        frames = fuzz_frames(args, conn, violation, lambda: fz.fingerprint(args.rpc_timeout),
                             lambda: fuzz.local_state(stores) if stores else None)
        time.sleep(0.1)
        final_fp = fz.fingerprint(args.rpc_timeout)
        up = fuzz.serving(cluster.addresses)
        try:
            pulled = fuzz.pull_all(cluster.addresses, timeout=args.rpc_timeout)
            pull_ok, same = True, fuzz.same_weights(pulled, weights)
        except (grpc.RpcError, shardps.ShardError) as e:
            pull_ok, same = False, False
            violation(args.cases, f"a valid pull failed at the end: {e}", None)
        alive = all(p.poll() is None for p in getattr(cluster, "_procs", []))
        backups_equal = None
        if args.replicas == 2 and cluster.stores:  # every shard's backup holds what its primary holds
            by_shard = {b.shard_index: b for b in cluster.backups}
            for st in cluster.stores:
                st.replica.replicated()
            backups_equal = all(st.state_hash() == by_shard[st.shard_index].state_hash() for st in cluster.stores)
            if not backups_equal:
                violation(args.cases, "a backup's state differs from its primary's", None)
    logged: collections.Counter[str] = collections.Counter()
    if server_log is not None:
        server_log.flush()
        with open(server_log.name, errors="replace") as f:
            lines = [line.strip() for line in f]
        server_log.close()
        for line in lines:
            m = re.search(r"(Exception calling application: .{0,80}|Exception deserializing message!)", line)
            if m:
                logged[m.group(1)] += 1
        unexplained = [m for m in logged if not any(re.search(pat, m) for pat in fuzz.LOG_PATTERNS.values())]
        for msg in unexplained:
            violation(args.cases, f"a server logged an exception no known bug explains: {msg}", None)
        if not unexplained:
            os.unlink(server_log.name)
            server_log = None
    else:
        for msg in errors.records:
            logged[msg.splitlines()[0][:120]] += 1
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
                    "platform": platform.platform()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet", "json")},
        "cases": args.cases,
        "elapsed_s": round(elapsed, 2),
        "total_s": round(time.monotonic() - t_start, 2),
        "cases_per_s": round(args.cases / elapsed, 1) if elapsed else None,
        "status_codes": dict(codes.most_common()),
        "kinds": dict(kinds.most_common()),
        "status_codes_by_kind": {k: dict(c.most_common()) for k, c in sorted(codes_by_kind.items())},
        "seconds_by_kind": {k: round(s, 2) for k, s in seconds_by_kind.most_common()},
        "verdicts": dict(verdicts),
        "unknown_or_internal": codes["UNKNOWN"] + codes["INTERNAL"],
        "known_bugs": dict(known.most_common()),
        "known_bug_examples": known_examples,
        "server_logged_exceptions": dict(logged.most_common()),
        "server_log": server_log.name if server_log is not None else None,  # kept when it shows something new
        "violations": n_violations,
        "violation_examples": violations,
        "generator_defects": generator_defects,
        "frames": frames,  # cases a generator raised on (not sent): seed, case, error, where
        "state_changes": state_changes,
        "state_unchanged": not state_changes and final_fp == first_fp,
        "final_state_equals_last_baseline": final_fp == baseline_fp,
        "serving": up and alive,
        "valid_pull_ok": pull_ok,
        "weights_unchanged": same,
        "backups_equal_primaries": backups_equal,
    }


def fuzz_frames(args: argparse.Namespace, conn: dict[str, Any], violation: Any, fingerprint: Any,
                local: Any) -> dict[str, Any]:
    """``--frames`` damaged frames (shardps/testing/fuzz/gen_frames.py) on worker 0's data connection to the first
    server process, each on a connection of its own: every answer a refusal, the state as before."""
    if not args.frames:
        return {"cases": 0}
    if not conn:
        violation(args.cases, "the servers offered no data connection: the frames were not fuzzed", None)
        return {"cases": 0}
    rng = random.Random(args.seed + 1)
    before_fp, before_local = fingerprint(), local()
    defects: collections.Counter[str] = collections.Counter()
    t0 = time.monotonic()
    for i in range(1, args.frames + 1):
        defect = gen_frames.DEFECTS[(i - 1) % len(gen_frames.DEFECTS)] if i <= len(gen_frames.DEFECTS) else None
        case = gen_frames.make_case(rng, rng.choice(conn["shards"]), conn["worker_id"], defect)
        defects[case.defect] += 1
        try:
            answers = gen_frames.send_case(conn["host"], conn["port"], conn["token"], conn["worker_id"], case,
                                           timeout=args.rpc_timeout)
        except (OSError, ConnectionError) as e:
            violation(args.cases + i, f"frame case {i} ({case.defect}): the data port failed: {e}", None)
            break
        broke = gen_frames.judge_answers(case, answers)
        if broke:
            violation(args.cases + i, f"frame case {i}: {broke}", None)
        now = local()
        if now is not None and now != before_local:
            violation(args.cases + i, f"frame case {i} ({case.defect}): the shards' state changed", None)
            before_local = now
        if i % args.progress_every == 0 or i == args.frames:
            _log(args, f"[frames {i}/{args.frames}] {time.monotonic() - t0:.1f}s")
    if fingerprint() != before_fp:
        violation(args.cases + args.frames, "the shards' state changed during the frame cases", None)
    return {"cases": args.frames, "defects": dict(defects.most_common()),
            "seconds": round(time.monotonic() - t0, 2)}


def report(res: dict[str, Any]) -> str:
    lines = [f"fuzz.py {res['date']}: {res['cases']} cases in {res['elapsed_s']} s "
             f"({res['cases_per_s']} cases/s), seed {res['settings']['seed']}, "
             f"{res['settings']['shards']} shard(s) "
             f"{'as processes' if res['settings']['processes'] else 'in process'}, "
             f"sync {res['settings']['sync']}, avoid known bugs: {res['settings']['avoid_known_bugs']}", "",
             "status code           count"]
    for code, n in res["status_codes"].items():
        lines.append(f"  {code:<20}{n:>6}")
    lines += ["", "kind        cases  seconds  status codes"]
    for kind, n in res["kinds"].items():
        by = ", ".join(f"{c} {k}" for c, k in res["status_codes_by_kind"][kind].items())
        lines.append(f"  {kind:<10}{n:>6}  {res['seconds_by_kind'].get(kind, 0):>7}  {by}")
    lines += ["", f"UNKNOWN or INTERNAL answers: {res['unknown_or_internal']}"]
    for bug, n in res["known_bugs"].items():
        lines.append(f"  known bug {bug}: {n}  ({fuzz.KNOWN_BUGS[bug].summary})")
    lines.append(f"exceptions the servers logged: {sum(res['server_logged_exceptions'].values())}")
    for msg, n in res["server_logged_exceptions"].items():
        lines.append(f"  {n:>6}  {msg}")
    fr = res.get("frames") or {}
    if fr.get("cases"):
        lines.append(f"frames: {fr['cases']} damaged frames on a data connection in {fr['seconds']}s, "
                     f"{len(fr['defects'])} kinds")
    lines.append(f"violations: {res['violations']}")
    for v in res["violation_examples"]:
        lines.append(f"  case {v['case']}: {v['reason']}\n    {(v['request'] or '')[:800]}")
    lines.append(f"generator defects: {len(res['generator_defects'])}")
    for g in res["generator_defects"][:20]:
        lines.append(f"  seed {g['seed']}, case {g['case']}: {g['error']} ({g['where']})")
    lines.append(f"state changes: {len(res['state_changes'])} "
                 f"({', '.join(str(s['known_bug'] or 'UNEXPLAINED') for s in res['state_changes'][:10])})")
    lines.append(f"state unchanged: {res['state_unchanged']}; servers serving: {res['serving']}; "
                 f"valid pull: {res['valid_pull_ok']}, weights as before: {res['weights_unchanged']}")
    if res["backups_equal_primaries"] is not None:
        lines.append(f"backups hold the primaries' state: {res['backups_equal_primaries']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10000, help="cases to send (default 10000)")
    p.add_argument("--frames", type=int, default=None,
                   help="damaged frames on a data connection after the cases (default: as many as --cases)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the case generator (default: a fresh random one, printed first: replay a failure "
                        "with --seed and the job's flags)")
    p.add_argument("--all-shapes", action="store_true",
                   help="run every job shape in turn (1 shard, 2 shards, 2 shards with backups; asp, bsp, "
                        "every:2, ssp:1), --cases each, one seed; a table at the end")
    p.add_argument("--shards", type=int, default=1, help="servers in the job (default 1)")
    p.add_argument("--sync", default="asp", help="the job's sync mode (default asp)")
    p.add_argument("--workers", type=int, default=2, help="registered workers (default 2)")
    p.add_argument("--steps", type=int, default=2, help="valid steps each worker pushes first (default 2)")
    p.add_argument("--processes", action="store_true", help="run each shard as a `shardps server` process")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                   help="2: every shard has a backup (needs --shards 2 or more); in process, the backups' state "
                        "is compared with the primaries' at the end")
    p.add_argument("--avoid-known-bugs", action="store_true", help="keep the generators away from KNOWN_BUGS")
    p.add_argument("--check-every", type=int, default=250,
                   help="with --processes: compare the state every N cases (default 250)")
    p.add_argument("--progress-every", type=int, default=1000, help="a progress line every N cases (default 1000)")
    p.add_argument("--keep", type=int, default=20, help="violations kept in the report (default 20)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="deadline of the set-up and check RPCs (default 30)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for servers to come up (default 60)")
    p.add_argument("--max-seconds", type=float, default=1800.0,
                   help="watchdog: abort the whole run after this many seconds (default 1800)")
    args = p.parse_args(argv)
    if args.cases < 1 or args.shards < 1 or args.workers < 1 or args.steps < 0 or args.check_every < 1 \
            or args.progress_every < 1:
        p.error("need --cases, --shards, --workers, --check-every, --progress-every >= 1 and --steps >= 0")
    if args.frames is None:
        args.frames = args.cases

    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    print(f"fuzz.py: seed {args.seed}", file=sys.stderr, flush=True)
    if not args.all_shapes:
        res = run_guarded("fuzz.py", args.max_seconds, lambda: run(args), lambda: cluster_processes(_CLUSTERS))
        if res is None:
            return 130
        print(json.dumps(res, indent=2) if args.json else report(res))
        return status(res)
    shapes = [argparse.Namespace(**{**vars(args), "shards": n, "replicas": r, "sync": sync})
              for n, r in SHAPES for sync in SYNCS]
    results: list[dict[str, Any]] = []

    def every_shape() -> None:
        for shape in shapes:
            _log(args, f"fuzz.py: shape {_shape(shape)}")
            results.append(run(shape))
            if not args.json:
                print(report(results[-1]) + "\n", flush=True)

    done = run_guarded("fuzz.py", args.max_seconds * len(shapes), lambda: every_shape() or True,
                       lambda: cluster_processes(_CLUSTERS))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(table(results))
        for r in results:
            for g in r["generator_defects"]:
                print(f"generator defect ({_shape(argparse.Namespace(**r['settings']))}): seed {g['seed']}, "
                      f"case {g['case']}: {g['error']} ({g['where']})")
    return 130 if done is None else max(status(r) for r in results)


SHAPES = ((1, 1), (2, 1), (2, 2))  # (shards, replicas)
SYNCS = ("asp", "bsp", "every:2", "ssp:1")


def _shape(ns: argparse.Namespace) -> str:
    return f"{ns.shards} shard(s), replicas {ns.replicas}, {ns.sync}"


def status(res: dict[str, Any]) -> int:
    """0 clean; 2 open known bugs hit and nothing else; 1 anything unexplained (a generator defect too)."""
    unexplained = res["violations"] or res["generator_defects"] or not res["serving"] or not res["valid_pull_ok"] \
        or any(s["known_bug"] is None for s in res["state_changes"]) \
        or (not res["state_changes"] and not res["state_unchanged"])
    if unexplained:
        return 1
    return 2 if res["known_bugs"] else 0


def table(results: Sequence[dict[str, Any]]) -> str:
    """One row per job shape: the markdown table of docs/history/performance-log.md ("Fuzzing and soak")."""
    lines = ["| shards | replicas | sync | seed | cases | violations | state unchanged | seconds |",
             "|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in results:
        st = r["settings"]
        lines.append(f"| {st['shards']} | {st['replicas']} | {st['sync']} | {st['seed']} | {r['cases']} | "
                     f"{r['violations']} | {r['state_unchanged'] and not r['state_changes']} | {r['elapsed_s']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
