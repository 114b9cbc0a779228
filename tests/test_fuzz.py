"""Fuzzing a live server: malformed and random requests get a proper status and change nothing.

shardps/testing/fuzz/ builds the requests and judges the answers (its docstring
has the rules); hypothesis drives its choices here, derandomized, so every
run sends the same cases: EXAMPLES to each job shape the fuzzer supports (1
and 2 shards, with and without backups; asp, bsp, every:2, ssp:1). A bug
that only one path shows (2026-12-01: a Push whose messages disagreed on
found_inf was applied) hides from a fuzzer that runs one shape. `make fuzz`
(benchmarks/fuzz.py --all-shapes) runs the same generators for 10,000+
cases per shape with a fresh seed.

Every bug the fuzzer has found is in fuzz.KNOWN_BUGS with a reproducer
below (test_found_bug). While a bug is open (KnownBug.open) its reproducer
is xfail(strict=True) and the generators steer clear of it here
(avoid_known_bugs=True); once fixed, the reproducer is a plain regression
test and the generators go back to the inputs that triggered it. All of
them are fixed at the time of writing.
"""

from __future__ import annotations

import collections
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing import fuzz
from tests.helpers import on_return

EXAMPLES = 200  # per job shape below: 2,400 cases in all
SHAPES = [(sync, n, r) for n, r in ((1, 1), (2, 1), (2, 2)) for sync in ("asp", "bsp", "every:2", "ssp:1")]


@st.composite
def cases(draw, target):
    """A case, or the GeneratorDefect of a generator that raised (counted; the run goes on, then fails)."""
    return fuzz.draw_case(fuzz.HypothesisSource(draw), target, avoid_known_bugs=True)


@pytest.mark.parametrize("sync, num_servers, replicas", SHAPES)
def test_fuzzed_requests_are_refused_cleanly_and_change_nothing(make_cluster, sync, num_servers, replicas):
    cluster = make_cluster(num_servers, lease_s=0, replicas=replicas)  # lease 0: the idle setup workers stay
    weights = fuzz.prepare_job(cluster.addresses, sync)
    seen: collections.Counter[str] = collections.Counter()
    generator_defects: list[str] = []
    stores = cluster.stores + cluster.backups
    with fuzz.Fuzzer(cluster.addresses, cluster.backup_addresses) as fz, \
            fuzz.capture_server_errors() as errors:
        target = fz.describe()
        before, local = fz.fingerprint(), fuzz.local_state(stores)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases(target))
        def check(case):
            seen["drawn"] += 1
            if isinstance(case, fuzz.GeneratorDefect):  # nothing to send: reported at the end
                generator_defects.append(f"example {seen['drawn']}: {case.error} ({case.where})")
                return
            mark = len(errors.records)
            out = fz.send(case)
            verdict = fuzz.judge(case, out, errors.since(mark))
            assert verdict.kind != "violation", f"{verdict.reason}\n{case!r}"
            # An open bug the generators could not avoid (bytes that are not protobuf) is tolerated.
            assert verdict.kind != "known" or verdict.bug == "malformed-protobuf", f"{verdict.reason}\n{case!r}"
            assert fuzz.local_state(stores) == local, f"the shard's state changed:\n{case!r}"
            seen[verdict.kind] += 1

        check()
        assert fz.fingerprint() == before
    assert not generator_defects, f"generator defects ({sync}, {num_servers} shard(s), replicas {replicas}):\n" + \
        "\n".join(generator_defects)
    # The generators reach past the first checks: most cases are refused, some succeed (no-ops).
    assert seen["refused"] > EXAMPLES // 2 and seen["ok"] > 0, seen
    assert fuzz.serving(cluster.addresses)
    assert fuzz.same_weights(fuzz.pull_all(cluster.addresses), weights)
    backup_of = {b.shard_index: b for b in cluster.backups}
    for store in cluster.stores if replicas == 2 else ():  # nothing reached the backups either
        assert store.state_hash() == backup_of[store.shard_index].state_hash()


# -- reproducers of the bugs the fuzzer found -----------------------------------


def _register(*messages: ps_pb2.RegisterRequest) -> fuzz.Case:
    return fuzz.Case("register", "Register", 0, messages=list(messages))


def _new_tensor(params_json: str = "", n: int = 2) -> ps_pb2.TensorSpec:
    return ps_pb2.TensorSpec(name="x", shape=[n], dtype=ps_pb2.FLOAT32,
                             optimizer=ps_pb2.OptimizerSpec(name="sgd", params_json=params_json),
                             parts=[ps_pb2.Part(start=0, stop=n)])


def _repro(bug: str, target: fuzz.Target) -> tuple[fuzz.Case, set[str]]:
    """The smallest case that shows ``bug`` (the job of prepare_job(..., "asp"), one shard) and the codes it
    should get."""
    job = dict(worker_id=0, num_workers=2, sync="asp")
    if bug == "malformed-protobuf":
        return fuzz.Case("raw", "SetSync", 0, raw=[b"\xff"], malformed=True), {"INVALID_ARGUMENT"}
    if bug == "malformed-stream-prefix-applied":
        # A valid header-only push of worker 0's next step, then a message that does not parse.
        step = target.shards[0].clocks[0] + 1
        raw = [ps_pb2.PushRequest(worker_id=0, step=step).SerializeToString(), b"\xff"]
        # The status is malformed-protobuf's business; this one is about the state.
        internal = {"INTERNAL"} if fuzz.KNOWN_BUGS["malformed-protobuf"].open else set()
        return fuzz.Case("raw", "Push", 0, raw=raw, malformed=True), {"INVALID_ARGUMENT", *internal}
    if bug == "json-int-overflow":
        return _register(ps_pb2.RegisterRequest(**job, tensors=[_new_tensor('{"lr": 1' + "0" * 400 + "}")])), \
            {"INVALID_ARGUMENT"}
    if bug == "json-recursion":
        return _register(ps_pb2.RegisterRequest(**job, tensors=[_new_tensor("[" * 100000)])), {"INVALID_ARGUMENT"}
    if bug == "huge-part-allocation":
        n = 2**40  # 4 TiB of fp32
        first = ps_pb2.RegisterRequest(**job, tensors=[_new_tensor(n=n)], provides_values=True)
        values = ps_pb2.RegisterRequest(chunk=ps_pb2.Chunk(name="x", offset=0, dtype=ps_pb2.FLOAT32, data=b"\0" * 4))
        return _register(first, values), {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
    if bug == "oversized-error-details":
        return fuzz.Case("pull", "Pull", 0, messages=[ps_pb2.PullRequest(names=["n" * 20000])]), {"NOT_FOUND"}
    if bug == "mixed-found-inf-accepted":
        # What the fuzzer sent (seed 20261201): two header-only messages of worker 1's next step, the second
        # saying found_inf; no ends_with_last, so no message may raise it.
        head = dict(worker_id=1, step=target.shards[0].clocks[1] + 1, base_version=target.shards[0].version)
        return fuzz.Case("push", "Push", 0, messages=[ps_pb2.PushRequest(**head),
                                                         ps_pb2.PushRequest(**head, found_inf=True)]), \
            {"INVALID_ARGUMENT"}
    raise AssertionError(bug)


class _Handled(grpc.ServerInterceptor):
    """Counts the calls whose handlers have not returned yet (``running``): a test that waits for 0 reads the
    shards' state after every handler is done, not a moment after the client saw its answer (a stream's handler
    may still be reading it then: gRPC answers a message that does not parse from its receive path). A unary
    call whose request does not parse never reaches its handler: it counts as returned once that is known."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running = 0

    def _done(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def idle(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.running == 0, timeout=timeout)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        with self.cond:
            self.running += 1
        return on_return(handler, lambda request: self._done(), refused=self._done)


@pytest.mark.parametrize("bug", [
    pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=f"open bug {name}: {bug.summary}")] if bug.open
                 else [])
    for name, bug in fuzz.KNOWN_BUGS.items()
])
def test_found_bug(make_cluster, bug):
    """The reproducer of ``bug`` gets a proper refusal and changes nothing."""
    handled = _Handled()
    cluster = make_cluster(1, lease_s=0, interceptors=[handled])
    fuzz.prepare_job(cluster.addresses, "asp")
    with fuzz.Fuzzer(cluster.addresses) as fz:
        case, codes = _repro(bug, fz.describe())
        assert handled.idle(60)
        local = fuzz.local_state(cluster.stores)
        out = fz.send(case)
        # The handler of a stream the client saw fail may still be running: the state is read once it returned.
        assert handled.idle(60), "a handler still running after 60 s"
        changed = fuzz.local_state(cluster.stores) != local
        assert fuzz.serving(cluster.addresses)
        assert out.code in codes and not changed, f"{out.code}: {out.details[:200]}; state changed: {changed}"
