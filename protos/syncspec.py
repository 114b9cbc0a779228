"""Synchronization modes as values: ``bsp``, ``asp``, ``every:X``, ``ssp:S``.

Both sides parse the same strings: the worker to know when to push
(``accumulation``) and what to wait for (``min_clock``), the server to know
when to apply (server/sync.py's ``make_policy``). The worker asks only
these, never the kind: a new mode is this file and its policy.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("bsp", "asp", "every", "ssp")


@dataclass(frozen=True)
class SyncSpec:
    """``kind`` is one of KINDS; ``every`` is X for ``every:X`` (1 otherwise);
    ``staleness`` is S for ``ssp:S`` (0 otherwise)."""

    kind: str
    every: int = 1
    staleness: int = 0

    @property
    def barrier(self) -> bool:
        """True when a shard waits for every worker before applying."""
        return self.kind in ("bsp", "every")

    @property
    def bounded(self) -> bool:
        """True for ssp: workers wait for the slowest to be within S clocks."""
        return self.kind == "ssp"

    @property
    def accumulation(self) -> int:
        """Local steps a worker sums before it pushes their mean (X for every:X, else 1)."""
        return self.every if self.kind == "every" else 1

    def min_clock(self, clock: int) -> int:
        """The slowest worker's clock a worker at ``clock`` waits for before its next step (0: none)."""
        return max(0, clock - self.staleness) if self.bounded else 0

    def __str__(self) -> str:
        if self.kind == "every":
            return f"every:{self.every}"
        if self.kind == "ssp":
            return f"ssp:{self.staleness}"
        return self.kind

    @classmethod
    def parse(cls, text: str) -> SyncSpec:
        t = text.strip().lower()
        if t in ("bsp", "asp"):
            return cls(t)
        if t.startswith("every:"):
            try:
                x = int(t.split(":", 1)[1])
            except ValueError:
                x = 0
            if x < 1:
                raise ValueError(f"sync {_shown(text)}: expected every:X with a whole number X >= 1")
            return cls("every", x)
        if t.startswith("ssp:"):
            try:
                s = int(t.split(":", 1)[1])
            except ValueError:
                s = -1
            if s < 0:
                raise ValueError(f"sync {_shown(text)}: expected ssp:S with a whole number S >= 0")
            return cls("ssp", staleness=s)
        raise ValueError(f"unknown sync mode {_shown(text)}; expected bsp, asp, every:X or ssp:S")


def _shown(text: str, most: int = 60) -> str:
    """``text`` as an error message quotes it: its start only when it is long (a status message is cut at a few
    KB, and what was expected comes after it)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text)} characters)"
