"""The choice of ``MoE(placement="auto")``: pull the experts or send the tokens, per step (docs/moe.md).

Two sources, in this order of trust:

1. Measured step times. A training step's time is the wall time from a
   training forward of the layer to the optimizer's push of its experts
   (the forward, the backward and whatever else the model does between:
   the same under both placements); the last ``window`` of them are kept
   per placement and per batch size (tokens per step, bucketed by powers
   of two), and a placement's time is their median: a step slowed by
   other work on the machine does not swing the choice, as it did an
   average. Once both placements have ``probes`` times for this batch
   size, the faster is taken, and every ``reprobe`` steps the other once
   again (the link or the load may have changed).
2. Before that, the cost model (``CostModel``, ``MoE.cost``: the seconds
   each placement's step would take for this batch's routing): its choice
   first, then the two in turn until each has ``probes`` times.

The cost model. A step of either placement is two round trips to the
shards (pull: the rows' pull and the gradients' push; send: ``Forward`` and
``Backward``) and then, per distinct expert and per token-assignment:

- pull: ``pull_call_s + U x (2 (4P + 16) byte_s + local_expert_s) + U^2 x
  local_expert_sq_s + A x 6P local_flop_s``: each routed expert's row down
  and its gradient up, its forward and backward run here (a fixed part per
  expert: the small matmuls, autograd and the row's gradient; and 3 x 2P
  flops a token: forward, and a backward of twice that). The U^2 term: on
  this machine the cost per expert grows with the experts a step routes to
  (about nothing each at 8, over 1 ms each at 32: docs/moe.md), which a
  constant per expert fitted at 32 charges 8 experts too much for;
- send: ``send_call_s + U x server_expert_s + U^2 x server_expert_sq_s +
  A x (5 x 4d byte_s + 8P server_flop_s)``: the tokens out and back, then the tokens and their
  output gradients out and the tokens' gradients back; on the shards the
  forward, then in the backward the forward again and its backward (4 x
  2P flops a token), and per expert a fixed part (its row loaded into the
  program twice, the calls, the row's update);

with U the distinct experts kept, A the kept assignments, P an expert's
parameters and d the layer's ``d_model``. The bytes alone (what the model
was before) put the crossover 2.4-3.4x too early on loopback, where a
step's time goes to the fixed costs per expert more than to the link:
docs/moe.md, "The cost model". The defaults are this repository's machine's, measured by
``benchmarks/moe.py costs``; ``MoE(cost_model=...)`` takes another's.

A step that a second forward interrupts before the push is not counted.
Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACES = ("pull", "send")


@dataclass(frozen=True)
class CostModel:
    """Seconds of one training step of an MoE layer under each placement (the module docstring). The
    defaults: ``benchmarks/moe.py costs`` on a 2-core machine shared with other work, 2 server processes
    on loopback (docs/moe.md, "The cost model", where the command, time, commit and load are). The fixed
    parts include the benchmark's other layers' pushes; only their difference decides."""

    byte_s: float = 4.43e-9  # a payload byte on the link (row, gradient or token), per byte
    pull_call_s: float = 29.3e-3  # pull's fixed part of a step: the pull and the push of the rows
    local_expert_s: float = 2.26e-3  # an expert run here: forward and backward, the fixed part
    local_flop_s: float = 1.73e-11  # a flop run here
    send_call_s: float = 26.9e-3  # send's fixed part of a step: Forward and Backward
    server_expert_s: float = 0.596e-3  # an expert run on the shards: Forward and Backward, the fixed part
    server_flop_s: float = 1.17e-11  # a flop run on the shards
    # The cost per expert that grows with the experts routed to (U^2 x this): 0 in the defaults, which were
    # fitted without it; ``benchmarks/moe.py costs`` measures it (the module docstring).
    local_expert_sq_s: float = 0.0
    server_expert_sq_s: float = 0.0

    def seconds(self, *, experts: float, assignments: float, params: int, d_model: int) -> dict[str, float]:
        """Each placement's step for ``experts`` distinct experts kept and ``assignments`` kept assignments
        (expected values will do: the benchmark's model crossover), experts of ``params`` parameters."""
        flops = 2 * params * assignments  # one forward of the kept assignments
        pull = (self.pull_call_s + experts * (2 * (4 * params + 16) * self.byte_s + self.local_expert_s)
                + experts ** 2 * self.local_expert_sq_s + 3 * flops * self.local_flop_s)
        send = (self.send_call_s + experts * self.server_expert_s + experts ** 2 * self.server_expert_sq_s
                + assignments * 5 * 4 * d_model * self.byte_s + 4 * flops * self.server_flop_s)
        return {"pull": pull, "send": send}


@dataclass
class AutoPlacement:
    reprobe: int = 64  # steps between tries of the slower placement
    window: int = 5  # step times kept per (bucket, placement); their median is the placement's time
    probes: int = 3  # times each placement gets before the faster is taken (a median of 3 outvotes one slow step)
    samples: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # (bucket, placement): seconds
    steps: dict[int, int] = field(default_factory=dict)  # training steps seen per bucket
    open: tuple[int, str, float] | None = None  # the step under way: (bucket, placement, its start)

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(1, tokens).bit_length()

    def close(self, now: float, *, valid: bool = True) -> None:
        """The step under way ended at ``now`` (its push); ``valid`` False: forget it, uncounted."""
        if self.open is not None and valid:
            b, p, t0 = self.open
            kept = self.samples.setdefault((b, p), [])
            kept.append(now - t0)
            del kept[:-self.window]
        self.open = None

    def time(self, bucket: int, placement: str) -> float | None:
        """The median of the kept step times of ``placement`` for ``bucket`` (None: none yet)."""
        kept = sorted(self.samples.get((bucket, placement), ()))
        if not kept:
            return None
        mid = len(kept) // 2
        return kept[mid] if len(kept) % 2 else (kept[mid - 1] + kept[mid]) / 2

    def choose(self, tokens: int, cost: dict[str, float]) -> str:
        """The placement for a step of ``tokens`` whose predicted seconds under each placement are ``cost``."""
        b = self.bucket(tokens)
        n = self.steps.get(b, 0)
        self.steps[b] = n + 1
        by_model = min(PLACES, key=lambda p: (cost[p], p != "pull"))
        counts = {p: len(self.samples.get((b, p), ())) for p in PLACES}
        if min(counts.values()) < self.probes:  # probing: the one with fewer times, the model's first
            return min(PLACES, key=lambda p: (counts[p], p != by_model))
        known = {p: self.time(b, p) or 0.0 for p in PLACES}
        fast = min(PLACES, key=lambda p: (known[p], p != "pull"))
        if self.reprobe and n % self.reprobe == self.reprobe - 1:
            return next(p for p in PLACES if p != fast)
        return fast

    def start(self, tokens: int, placement: str, now: float) -> None:
        """A training step of ``placement`` starts at ``now``."""
        self.open = (self.bucket(tokens), placement, now)
