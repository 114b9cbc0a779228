"""Optional remedies for stale gradients under asp/ssp. Off by default.

- ``lr-scale``: the step of a gradient with staleness s uses the learning rate
  divided by (s + 1). After Zhang, Gupta, Lian & Liu, "Staleness-aware
  Async-SGD for Distributed Deep Learning" (IJCAI 2016), which divides by s;
  the +1 keeps fresh gradients (s = 0) at the full rate.
- ``dc-asgd:LAMBDA``: delay compensation, Zheng et al., "Asynchronous
  Stochastic Gradient Descent with Delay Compensation" (ICML 2017), the
  constant-lambda form: g + lambda * g * g * (w - w_stale), where w_stale is
  the weights the worker last pulled (the shard keeps a copy per worker:
  one more copy of the shard's weights for every worker).

Under bsp and every:X every gradient has staleness 0 and was computed from
the current weights, so both remedies leave it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardps.server.replication.roles import StrEnum


class RemedyKind(StrEnum):
    NONE = "none"
    LR_SCALE = "lr-scale"
    DC_ASGD = "dc-asgd"


@dataclass(frozen=True)
class Remedy:
    """A staleness remedy as the job runs it: its kind and, for dc-asgd, its lambda."""

    kind: RemedyKind = RemedyKind.NONE
    dc_lambda: float = 0.0

    def __str__(self) -> str:
        return f"dc-asgd:{self.dc_lambda:g}" if self.kind is RemedyKind.DC_ASGD else str(self.kind)

    @classmethod
    def parse(cls, text: str | None) -> Remedy:
        t = (text or "none").strip().lower()
        if t in ("none", ""):
            return cls()
        if t == RemedyKind.LR_SCALE:
            return cls(RemedyKind.LR_SCALE)
        if t.startswith(RemedyKind.DC_ASGD):
            _, _, lam = t.partition(":")
            try:
                value = float(lam) if lam else 0.04
            except ValueError:
                value = -1.0
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"staleness remedy {text!r}: dc-asgd:LAMBDA needs a number >= 0")
            return cls(RemedyKind.DC_ASGD, value)
        raise ValueError(f"unknown staleness remedy {text!r}; expected none, lr-scale or dc-asgd:LAMBDA")


def lr_factor(staleness: float) -> float:
    """The lr-scale factor for a gradient of the given staleness."""
    return 1.0 / (staleness + 1.0)


def compensate(grad: torch.Tensor, weight: torch.Tensor, stale: torch.Tensor, lam: float) -> torch.Tensor:
    """DC-ASGD: ``grad + lam * grad * grad * (weight - stale)``, in place on ``grad``."""
    grad.addcmul_(grad * grad, weight.view(grad.shape) - stale.view(grad.shape), value=lam)
    return grad
