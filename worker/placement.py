"""The choice of ``MoE(placement="auto")``: pull the experts or send the tokens, per step (docs/moe.md).

Two sources, in this order of trust:

1. Measured step times. A training step's time is the wall time from a
   training forward of the layer to the optimizer's push of its experts
   (the forward, the backward and whatever else the model does between:
   the same under both placements); each is kept per placement and per
   batch size (tokens per step, bucketed by powers of two) as an
   exponential moving average. Once
   both placements have a time for this batch size, the faster is taken,
   and every ``reprobe`` steps the other once again (the link or the load
   may have changed).
2. Before that, the cost model (``MoE.cost``: the bytes each placement
   would move for this batch's routing); a placement with no time yet for
   this batch size is tried once.

A step that a second forward interrupts before the push is not counted.
Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACES = ("pull", "send")


@dataclass
class AutoPlacement:
    reprobe: int = 64  # steps between tries of the slower placement
    alpha: float = 0.5  # weight of the newest time in the average
    times: dict[tuple[int, str], float] = field(default_factory=dict)  # (bucket, placement): seconds a step
    steps: dict[int, int] = field(default_factory=dict)  # training steps seen per bucket
    open: tuple[int, str, float] | None = None  # the step under way: (bucket, placement, its start)

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(1, tokens).bit_length()

    def close(self, now: float, *, valid: bool = True) -> None:
        """The step under way ended at ``now`` (its push); ``valid`` False: forget it, uncounted."""
        if self.open is not None and valid:
            b, p, t0 = self.open
            old = self.times.get((b, p))
            dt = now - t0
            self.times[(b, p)] = dt if old is None else self.alpha * dt + (1 - self.alpha) * old
        self.open = None

    def choose(self, tokens: int, cost: dict[str, int]) -> str:
        """The placement for a step of ``tokens`` whose bytes under each placement are ``cost``."""
        b = self.bucket(tokens)
        n = self.steps.get(b, 0)
        self.steps[b] = n + 1
        known = {p: self.times[(b, p)] for p in PLACES if (b, p) in self.times}
        by_bytes = min(PLACES, key=lambda p: (cost[p], p != "pull"))
        if not known:
            return by_bytes
        if len(known) == 1:
            return next(p for p in PLACES if p not in known)  # try the other once
        fast = min(PLACES, key=lambda p: (known[p], p != "pull"))
        if self.reprobe and n % self.reprobe == self.reprobe - 1:
            return next(p for p in PLACES if p != fast)
        return fast

    def start(self, tokens: int, placement: str, now: float) -> None:
        """A training step of ``placement`` starts at ``now``."""
        self.open = (self.bucket(tokens), placement, now)
