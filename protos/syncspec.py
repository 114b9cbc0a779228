"""Synchronization modes as values: ``bsp``, ``asp``, ``every:X``.

Both sides parse the same strings: the worker to know when to push, the
server to know when to apply.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("bsp", "asp", "every")


@dataclass(frozen=True)
class SyncSpec:
    """``kind`` is one of KINDS; ``every`` is X for ``every:X`` (1 otherwise)."""

    kind: str
    every: int = 1

    @property
    def barrier(self) -> bool:
        """True when a shard waits for every worker before applying."""
        return self.kind in ("bsp", "every")

    def __str__(self) -> str:
        return f"every:{self.every}" if self.kind == "every" else self.kind

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
                raise ValueError(f"sync {text!r}: every:X needs a whole number X >= 1")
            return cls("every", x)
        raise ValueError(f"unknown sync mode {text!r}; expected bsp, asp or every:X")
