"""Judging an answer (``judge``) and collecting what the servers log meanwhile."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from shardps.testing.fuzz.bugs import KNOWN_BUGS
from shardps.testing.fuzz.cases import REFUSALS, Case
from shardps.testing.fuzz.gen_rows import rows_detail_ok
from shardps.testing.fuzz.send import Outcome

# -- judging -----------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    kind: str  # ok, refused, known, violation
    reason: str = ""
    bug: str | None = None


def judge(case: Case, out: Outcome, server_errors: Sequence[str] = ()) -> Verdict:
    """Is ``out`` an acceptable answer to ``case``? ``server_errors``: what the server logged meanwhile."""
    v = _judge_status(case, out)
    unexplained = [m for m in server_errors if not _explained(m, v, case)]
    if unexplained and v.kind != "violation":
        return Verdict("violation", f"server logged an exception: {unexplained[0][:500]}")
    return v


def _judge_status(case: Case, out: Outcome) -> Verdict:
    for name, bug in KNOWN_BUGS.items():
        if bug.matches(case, out.code, out.details):
            if bug.open:
                return Verdict("known", f"{out.code}: {out.details[:300]}", name)
            return Verdict("violation", f"fixed bug {name} is back: {out.code}: {out.details[:300]}", name)
    if out.code == "OK":
        if not case.may_succeed:
            return Verdict("violation", f"{case.method} built to be refused ({', '.join(case.defects)}) succeeded")
        if out.bad_response:
            return Verdict("violation", out.bad_response)
        return Verdict("ok")
    if out.code in REFUSALS:
        vague = rows_detail_ok(case, out.details)
        if vague:
            return Verdict("violation", vague)
        if out.code == "DEADLINE_EXCEEDED" and not case.may_block:
            return Verdict("violation", f"DEADLINE_EXCEEDED after {out.seconds:.2f}s for a request that has "
                                        f"nothing to wait for (a hang?): {out.details[:300]}")
        return Verdict("refused")
    return Verdict("violation", f"status {out.code}: {out.details[:500]}")


LOG_PATTERNS = {  # what the server logs when it hits a known bug
    "malformed-protobuf": r"^Exception deserializing message!",
    "json-int-overflow": r"^Exception calling application: int too large to convert to float",
    "json-recursion": r"^Exception calling application: maximum recursion depth exceeded",
    "huge-part-allocation": r"^Exception calling application: .*(allocate|overflow)",
}


def _explained(message: str, v: Verdict, case: Case) -> bool:
    if case.malformed and re.search(LOG_PATTERNS["malformed-protobuf"], message):
        return True
    pattern = LOG_PATTERNS.get(v.bug or "")
    return pattern is not None and re.search(pattern, message) is not None


class ServerErrors(logging.Handler):
    """Collects ERROR records of the ``grpc`` loggers (gRPC logs a handler's exception there)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock2:
            self.records.append(record.getMessage())

    def since(self, mark: int) -> list[str]:
        with self._lock2:
            return list(self.records[mark:])


@contextmanager
def capture_server_errors() -> Iterator[ServerErrors]:
    """In-process servers only: collect what gRPC logs about failing handlers (and keep it off stderr)."""
    h = ServerErrors()
    logger = logging.getLogger("grpc")
    logger.addHandler(h)
    try:
        yield h
    finally:
        logger.removeHandler(h)
