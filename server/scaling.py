"""Dynamic loss scaling on the shards, with torch.amp.GradScaler's semantics.

A worker multiplies its loss by the current scale, pushes the (scaled)
gradient with the scale it used and whether it found an inf/nan anywhere in
its gradient. The shard unscales in fp32; per optimizer step it asks the
scaler whether to skip (any contribution had an inf/nan) and updates the
scale: x backoff_factor and reset on a skip, x growth_factor after
growth_interval clean steps in a row. Every shard sees the same flags in the
same step order under bsp/every:X, so all shards keep the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardps.protos.amp import LossScaling
from shardps.protos.codec import all_finite


@dataclass
class LossScaler:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    scale: float = 0.0
    growth_tracker: int = 0

    def __post_init__(self) -> None:
        LossScaling(self.init_scale, self.growth_factor, self.backoff_factor, self.growth_interval)  # validates
        if self.scale == 0.0:
            self.scale = float(self.init_scale)

    def update(self, found_inf: bool) -> None:
        """After one optimizer step (applied, or skipped when ``found_inf``)."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0


ScalingConfig = tuple[float, float, float, int]  # init, growth, backoff, interval


def scaling_config(scaler: LossScaler | None) -> ScalingConfig | None:
    """The loss scaling a job was configured with (the scale itself moves), None when off."""
    if scaler is None:
        return None
    return (scaler.init_scale, scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval)


def inv_scale(scale: float) -> torch.Tensor:
    """1 / scale computed as GradScaler does: in float64, then rounded to fp32."""
    return torch.tensor(scale, dtype=torch.float64).reciprocal().float()


def unscale_and_check(grads: list[torch.Tensor], loss_scale: float) -> bool:
    """Multiply fp32 ``grads`` by 1/loss_scale in place (0: leave them); True if any holds inf/nan.

    With a scale this is GradScaler's own fused kernel (one pass for both);
    without one, a read-only min/max pass.
    """
    if not grads:
        return False
    if loss_scale:
        kernel = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
        inv = inv_scale(loss_scale)
        if kernel is not None:
            found = torch.zeros(1)
            kernel(grads, found, inv.reshape(1))
            return bool(found.item())
        for g in grads:
            g.mul_(inv)
    return not all(all_finite(g) for g in grads)
