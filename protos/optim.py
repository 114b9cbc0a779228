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
                f"nesterov needs momentum > 0 and dampening == 0, got momentum={self.momentum}, "
                f"dampening={self.dampening}",
            )


def _number(name: str, value: Any) -> None:
    _check(not isinstance(value, bool), f"{name} must be a finite number, got {value!r}")
    _finite(name, value)


def _flag(name: str, value: Any) -> None:
    _check(isinstance(value, bool), f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class Adafactor(OptimizerSpec):
    """Adafactor (Shazeer & Stern 2018), as HuggingFace ``transformers.Adafactor``.

    Names and defaults are HF's. With ``relative_step`` the step size is
    ``min(1e-2, 1/sqrt(t))`` (``warmup_init``: ``min(1e-6 t, 1/sqrt(t))``) and
    ``lr`` must be None; otherwise ``lr`` is required. ``scale_parameter``
    multiplies it by ``max(eps[1], RMS(theta))``. ``eps[0]`` is added to the
    squared gradient. Tensors of rank >= 2 keep factored second moments over
    their last two dims; ``beta1`` (None: off) adds a first moment of the
    update; ``weight_decay`` is HF's: ``theta -= weight_decay * alpha * theta``.

    Not ``torch.optim.Adafactor``: that one clamps with ``eps[0]`` instead of
    adding it, decays as ``theta *= 1 - lr * wd`` and has no ``beta1``.
    """

    name: ClassVar[str] = "adafactor"
    elementwise: ClassVar[bool] = False
    lr: float | None = None
    eps: tuple[float, float] = (1e-30, 1e-3)
    clip_threshold: float = 1.0
    decay_rate: float = -0.8
    beta1: float | None = None
    weight_decay: float = 0.0
    scale_parameter: bool = True
    relative_step: bool = True
    warmup_init: bool = False

    def validate(self) -> None:
        for k in ("scale_parameter", "relative_step", "warmup_init"):
            _flag(k, getattr(self, k))
        if self.lr is not None:
            _number("lr", self.lr)
            _check(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        _check(not (self.lr is not None and self.relative_step),
               "Cannot combine manual `lr` and `relative_step=True` options")
        _check(not (self.warmup_init and not self.relative_step),
               "`warmup_init=True` requires `relative_step=True`")
        _check(self.lr is not None or self.relative_step,
               "`relative_step=False` requires a manual `lr`")
        _check(isinstance(self.eps, tuple) and len(self.eps) == 2, f"eps must be a pair, got {self.eps!r}")
        for i, e in enumerate(self.eps):
            _number(f"eps[{i}]", e)
            _check(e >= 0, f"eps[{i}] must be >= 0, got {e}")
        _number("clip_threshold", self.clip_threshold)
        _check(self.clip_threshold > 0, f"clip_threshold must be > 0, got {self.clip_threshold}")
        _number("decay_rate", self.decay_rate)
        _check(self.decay_rate <= 0, f"decay_rate must be <= 0, got {self.decay_rate}")
        if self.beta1 is not None:
            _number("beta1", self.beta1)
            _check(0.0 <= self.beta1 < 1.0, f"beta1 must be None or in [0, 1), got {self.beta1}")
        _number("weight_decay", self.weight_decay)
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class SM3(OptimizerSpec):
    """SM3-II (Anil, Gupta, Koren & Singer 2019), as google-research ``sm3/sm3.py``.

    One accumulator per axis for tensors of rank >= 2 (an Adagrad accumulator
    for rank <= 1); update ``u = g / sqrt(nu + eps)``; with ``momentum`` m:
    ``gbar = m * gbar + (1 - m) * u``, ``theta -= lr * gbar``. The default
    ``lr = 0.1`` is the PyTorch SM3 port's (google-research takes no default);
    the paper suggests a quadratic warmup of ``lr`` and no decay, which is the
    caller's schedule.
    """

    name: ClassVar[str] = "sm3"
    elementwise: ClassVar[bool] = False
    lr: float = 0.1
    momentum: float = 0.0
    eps: float = 1e-30

    def validate(self) -> None:
        _number("lr", self.lr)
        _check(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        _number("momentum", self.momentum)
        _check(0.0 <= self.momentum < 1.0, f"momentum must be in [0, 1), got {self.momentum}")
        _number("eps", self.eps)
        _check(self.eps >= 0, f"eps must be >= 0, got {self.eps}")


@dataclass(frozen=True)
class SparseAdam(OptimizerSpec):
    """Adam for row tables, as ``torch.optim.SparseAdam``: the moments of untouched rows stay as they are,
    one step count per table (every push of the table counts, on every shard)."""

    name: ClassVar[str] = "sparse_adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def validate(self) -> None:
        _number("lr", self.lr)
        _check(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        _check(isinstance(self.betas, tuple) and len(self.betas) == 2, f"betas must be a pair, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _number(f"betas[{i}]", b)
            _check(0.0 <= b < 1.0, f"betas[{i}] must be in [0, 1), got {b}")
        _number("eps", self.eps)
        _check(self.eps > 0, f"eps must be > 0, got {self.eps}")


@dataclass(frozen=True)
class RowwiseAdagrad(OptimizerSpec):
    """FBGEMM's exact row-wise Adagrad: one float of state per row, ``s += mean(g**2)``,
    ``w -= lr * g / (sqrt(s) + eps)``."""

    name: ClassVar[str] = "rowwise_adagrad"
    lr: float = 1e-2
    eps: float = 1e-8

    def validate(self) -> None:
        _number("lr", self.lr)
        _check(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        _number("eps", self.eps)
        _check(self.eps > 0, f"eps must be > 0, got {self.eps}")


#: The optimizers a row table takes; SGD only with its plain update, SM3 without momentum.
ROW_SPECS: tuple[type[OptimizerSpec], ...] = (SparseAdam, RowwiseAdagrad, SGD, SM3)


def check_row_optimizer(spec: OptimizerSpec) -> None:
    """ValueError unless ``spec`` is a row table's optimizer with hyper-parameters it supports (never
    dropped: SGD's momentum, dampening, weight decay and Nesterov, and SM3's momentum, are refused, not
    ignored)."""
    if type(spec) not in ROW_SPECS:
        raise ValueError(f"optimizer {spec.name!r} does not step row tables; those take "
                         f"{sorted(c.name for c in ROW_SPECS)}")
    if isinstance(spec, SGD):
        unsupported = {k: v for k, v in spec.params().items() if k != "lr" and v not in (0.0, False)}
        _check(not unsupported, f"sgd on a row table takes lr only; unsupported here: {unsupported}")
    if isinstance(spec, SM3):
        _check(spec.momentum == 0, f"sm3 on a row table takes lr and eps; unsupported here: momentum="
                                   f"{spec.momentum} (SM3's sparse update has none)")


SPECS: dict[str, type[OptimizerSpec]] = {c.name: c for c in (Adam, AdamW, SGD, Adafactor, SM3)}
#: Every spec the wire carries: the dense ones and the row tables' own.
ALL_SPECS: dict[str, type[OptimizerSpec]] = {**SPECS, SparseAdam.name: SparseAdam, RowwiseAdagrad.name: RowwiseAdagrad}


def spec_from_proto(msg: ps_pb2.OptimizerSpec) -> OptimizerSpec:
    """Parse and validate a wire spec; ValueError naming what is wrong."""
    cls = ALL_SPECS.get(msg.name)
    if cls is None:
        raise ValueError(f"unknown optimizer {msg.name!r}; known: {sorted(ALL_SPECS)}")
    if len(msg.params_json) > 10_000:
        raise ValueError(f"{msg.name}: params_json of {len(msg.params_json)} characters is too long (10000 at most)")
    try:
        params = json.loads(msg.params_json) if msg.params_json else {}
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{msg.name}: params_json is not valid JSON: {type(e).__name__}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{msg.name}: params_json must be a JSON object, got {type(params).__name__}")
    try:
        return cls.from_params(params)
    except (OverflowError, TypeError, RecursionError) as e:
        raise ValueError(f"{msg.name}: bad hyperparameters: {type(e).__name__}: {e}") from None


def spec_from_name(name: str, **params: Any) -> OptimizerSpec:
    """``spec_from_name("adam", lr=3e-3)``: for command lines and configs."""
    cls = SPECS.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(SPECS)}")
    return cls.from_params(params)
