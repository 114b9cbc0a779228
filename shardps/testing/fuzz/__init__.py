"""Malformed and random requests for a live shardps server, and the rules they are judged by.

Modules: cases (the services, sources of choices, Target, Case), draws (names,
values, optimizer params), gen_push, gen_register, gen_rows, gen_other
(make_case over all kinds; draw_case, which returns a generator's exception
as a GeneratorDefect instead of raising it), send (Fuzzer), bugs
(KNOWN_BUGS), judge, job (the job it runs against). This package exports
what the tests and benchmarks/fuzz.py use.

Shared by tests/test_fuzz.py (hypothesis drives the choices, 2,400 cases)
and benchmarks/fuzz.py (a seeded ``random.Random`` drives them, 10,000+
cases). Every choice goes through a ``Source``, so the same generators run
under either.

What a case is: one RPC to one shard (``Case``), built from what the shard
reports about itself (``Target``, from ``Stats``), with its messages as
protobuf objects (sent with the generated stub) or as bytes (sent with a
generic callable and identity serializers: random or damaged protobuf).

The job (``prepare_job``) runs on servers without leases (``lease_s=0``:
the setup's workers sit idle while the fuzzer runs and would otherwise be
evicted, a legitimate change of state) and without checkpoints (so Rollback
and Checkpoint can only be no-ops or refused).

How a case is judged (``judge``): the answer must be a success or a status
from ``REFUSALS``; a success only where the case allows one
(``may_succeed``): every Push and every Register that could create a tensor
carries at least one deliberate defect (``defects``), each enough on its own
to have it refused, so no fuzzed request can legitimately change the shard's
state. The caller checks that the state is unchanged (``Fuzzer.fingerprint``
and, in process, ``local_state``: ``ShardStore.state_hash`` and the stats).
``KNOWN_BUGS`` lists every bug this fuzzer has found: an answer that matches
an open one is reported as that bug, one that matches a fixed one as a
regression (a violation); anything else outside the rules is a violation.
"""

from shardps.testing.fuzz.bugs import KNOWN_BUGS, KnownBug, avoiding
from shardps.testing.fuzz.cases import (
    CLIENT_STREAM,
    REFUSALS,
    SERVER_STREAM,
    Case,
    HypothesisSource,
    RandomSource,
    Source,
    Target,
    describe,
    method_path,
)
from shardps.testing.fuzz.gen_other import KINDS, GeneratorDefect, draw_case, make_case
from shardps.testing.fuzz.job import job_tensors, local_state, prepare_job, pull_all, same_weights
from shardps.testing.fuzz.judge import LOG_PATTERNS, Verdict, capture_server_errors, judge
from shardps.testing.fuzz.send import Fuzzer, Outcome, serving

__all__ = ["CLIENT_STREAM", "KINDS", "KNOWN_BUGS", "LOG_PATTERNS", "REFUSALS", "SERVER_STREAM", "Case", "Fuzzer",
           "GeneratorDefect", "HypothesisSource", "KnownBug", "Outcome", "RandomSource", "Source", "Target",
           "Verdict", "avoiding", "capture_server_errors", "describe", "draw_case", "job_tensors", "judge",
           "local_state", "make_case", "method_path", "prepare_job", "pull_all", "same_weights", "serving"]
