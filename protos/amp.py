"""Mixed-precision settings that travel in the proto: dynamic loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

from shardps.protos.shardps.v1 import ps_pb2


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s defaults, run on the shards."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")

    def to_proto(self) -> ps_pb2.LossScaling:
        return ps_pb2.LossScaling(enabled=True, init_scale=self.init_scale, growth_factor=self.growth_factor,
                                  backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)
