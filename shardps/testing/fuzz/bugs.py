"""Every bug the fuzzer has found (``KNOWN_BUGS``), and ``avoiding`` for the generators."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardps.testing.fuzz.cases import Case


@dataclass(frozen=True)
class KnownBug:
    code: str  # the status the bug shows as
    pattern: str  # in the status details
    summary: str
    open: bool  # still reproduces: tolerated and avoided; fixed ones that come back are violations
    malformed_only: bool = False  # only for requests that do not parse
    state_only: bool = False  # seen as a state change, not in the status (that is another bug's)

    def matches(self, case: Case, code: str, details: str) -> bool:
        return not self.state_only and code == self.code and re.search(self.pattern, details) is not None and (
            case.malformed or not self.malformed_only)


# Every bug this fuzzer has found; tests/test_fuzz.py has a reproducer of each
# (xfail while open, a regression test once fixed). Open bugs are reported as
# such and, with avoid_known_bugs=True, the generators steer clear of them
# (bytes that are not protobuf cannot avoid malformed-protobuf). Six were
# found on 2026-11-30 and fixed the same day in commit 3780004 (service.py:
# malformed requests are INVALID_ARGUMENT and end a stream with an error,
# details cut to 2000 characters; optim.py: params_json checks; server/datapath/assembly.py:
# parts over 2^32 elements are RESOURCE_EXHAUSTED). mixed-found-inf-accepted
# came in with overlap's streamed pushes and was found on 2026-12-01 with
# seeds the suite had never run; fixed by server/datapath/headers.py (one check of a
# stream's messages for Push, Register and Replicate). A bug seen only as a
# state change (state_only) never matches a status. The fuzzer's own defects
# (a generator that raises while drawing a case: fuzz.draw_case's
# GeneratorDefect) are not server bugs and are not listed here;
# tests/test_fuzzgen_seeds.py runs every generator over many seeds.
KNOWN_BUGS: dict[str, KnownBug] = {
    "malformed-protobuf": KnownBug(
        "INTERNAL", r"^Exception deserializing request!$",
        "bytes that do not parse as the request message get INTERNAL (gRPC's default for a "
        "deserializer that raises), not INVALID_ARGUMENT", open=False, malformed_only=True),
    "malformed-stream-prefix-applied": KnownBug(
        "INTERNAL", r"^Exception deserializing request!$",
        "in a Push or Register stream, a message that does not parse ends the stream early on the server "
        "(gRPC's request iterator stops instead of raising): the messages before it are applied, a partial "
        "gradient or a new tensor, while the client is told INTERNAL", open=False, malformed_only=True,
        state_only=True),
    "json-int-overflow": KnownBug(
        "UNKNOWN", r"int too large to convert to float",
        "an integer beyond float range in an optimizer's params_json (e.g. {\"lr\": 1 followed by 400 zeros}) "
        "raises OverflowError in OptimizerSpec.validate: UNKNOWN", open=False),
    "json-recursion": KnownBug(
        "UNKNOWN", r"maximum recursion depth exceeded",
        "deeply nested params_json (e.g. 100000 '[') raises RecursionError in json.loads: UNKNOWN", open=False),
    "huge-part-allocation": KnownBug(
        "UNKNOWN", r"allocate|Storage size calculation overflowed|overflow",
        "a Register declaring a part larger than memory, with initial values for it, makes "
        "ChunkAssembler allocate the whole part: torch raises RuntimeError, UNKNOWN", open=False),
    "mixed-found-inf-accepted": KnownBug(
        "OK", "",
        "a Push stream whose later message said found_inf where its first did not (or the other way) was "
        "accepted as one step, its flag the OR of the messages': the rule a streaming worker's last message "
        "needs, applied to every message of every stream", open=False, state_only=True),
    "oversized-error-details": KnownBug(
        "RESOURCE_EXHAUSTED", r"metadata size exceeds",
        "error messages echo request strings (names, shapes, sync) unbounded; past 16 KiB the client "
        "drops the status (RESOURCE_EXHAUSTED) and the real code and message are lost", open=False),
}


def avoiding(avoid: bool, bug: str) -> bool:
    """Whether a generator should stay clear of ``bug``'s trigger."""
    return avoid and KNOWN_BUGS[bug].open
