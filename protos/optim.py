"""Optimizer specs: names plus validated hyperparameters that travel in the proto.

A spec is what a user writes (``shardps.optim.Adam(lr=1e-3)``); the math that
runs it lives on the servers (``shardps.server.optim``). Hyperparameter names
and defaults follow ``torch.optim``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from shardps.protos.shardps.v1 import ps_pb2


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _finite(name: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and math.isfinite(value), f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class OptimizerSpec:
    """Base of all optimizer specs. Subclasses are frozen dataclasses."""

    name: ClassVar[str] = ""
    #: True when the update of each element depends on that element alone, so
    #: the tensor may be split across servers. Optimizers with row/column
    #: statistics (factored ones) set this to False.
    elementwise: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    def params(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        return ps_pb2.OptimizerSpec(name=self.name, params_json=json.dumps(self.params(), sort_keys=True))

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> OptimizerSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"{cls.name}: unknown hyperparameters {unknown}; known: {sorted(known)}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"{cls.name}: {e}") from None


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """Adam (Kingma & Ba), as ``torch.optim.Adam``: L2 weight decay added to the gradient."""

    name: ClassVar[str] = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    def validate(self) -> None:
        _finite("lr", self.lr)
        _check(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        _check(len(self.betas) == 2, f"betas must be a pair, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _finite(f"betas[{i}]", b)
            _check(0.0 <= b < 1.0, f"betas[{i}] must be in [0, 1), got {b}")
        _finite("eps", self.eps)
        _check(self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        _finite("weight_decay", self.weight_decay)
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _check(isinstance(self.amsgrad, bool), f"amsgrad must be a bool, got {self.amsgrad!r}")


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW (Loshchilov & Hutter), as ``torch.optim.AdamW``: decoupled weight decay."""

    name: ClassVar[str] = "adamw"
    weight_decay: float = 1e-2


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """SGD with optional momentum, dampening, Nesterov and L2 decay, as ``torch.optim.SGD``."""

    name: ClassVar[str] = "sgd"
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def validate(self) -> None:
        for k in ("lr", "momentum", "dampening", "weight_decay"):
            v = getattr(self, k)
            _finite(k, v)
            _check(v >= 0, f"{k} must be >= 0, got {v}")
        _check(isinstance(self.nesterov, bool), f"nesterov must be a bool, got {self.nesterov!r}")
        if self.nesterov:
            _check(
                self.momentum > 0 and self.dampening == 0,
                f"nesterov needs momentum > 0 and dampening == 0, got momentum={self.momentum}, dampening={self.dampening}",
            )


SPECS: dict[str, type[OptimizerSpec]] = {c.name: c for c in (Adam, AdamW, SGD)}


def spec_from_proto(msg: ps_pb2.OptimizerSpec) -> OptimizerSpec:
    """Parse and validate a wire spec; ValueError naming what is wrong."""
    cls = SPECS.get(msg.name)
    if cls is None:
        raise ValueError(f"unknown optimizer {msg.name!r}; known: {sorted(SPECS)}")
    try:
        params = json.loads(msg.params_json) if msg.params_json else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{msg.name}: params_json is not valid JSON: {e}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{msg.name}: params_json must be a JSON object, got {type(params).__name__}")
    return cls.from_params(params)


def spec_from_name(name: str, **params: Any) -> OptimizerSpec:
    """``spec_from_name("adam", lr=3e-3)``: for command lines and configs."""
    cls = SPECS.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(SPECS)}")
    return cls.from_params(params)
