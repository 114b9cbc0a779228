"""Row tables: what the worker and the server must agree on (docs/sparse.md).

A row table holds ``dim``-float rows addressed by 64-bit keys. Keys travel
as raw little-endian 64-bit integers; a key's owner is ``shard_of(keys, n)``
(a SplitMix64 hash of the key, so 0 and 2**64-1 are keys like any other and
consecutive ids spread evenly); a row's first value is ``init_rows(spec,
keys)``, a function of (seed, table name, key) alone, so it does not depend
on which server creates it or when (a resharded table is the same table).

Pure NumPy/torch, no gRPC: imported by both sides.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardps.protos import optim
from shardps.protos.shardps.v1 import ps_pb2

KEY_KINDS = ("int64", "hash")  # how the worker makes keys: int64 ids, or any hashable value hashed to 64 bits
KEY_DTYPES = {"int64": np.dtype("<i8"), "uint64": np.dtype("<u8")}  # how the wire's keys bytes are read
INIT_KINDS = ("normal", "uniform", "zeros")
ROW_ITEMSIZE = 4  # rows travel and live as fp32
MAX_PULL_KEYS = 1 << 18  # keys in one PullRows request (8 bytes each: well under a message's limit)
MAX_PUSH_KEYS = 1 << 24  # keys in one PushRows stream (a worker sends a step's distinct keys of a shard in one)

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def label(name: str) -> str:
    """A table's name as errors show it: quoted, its first 100 characters (a status message has a limit)."""
    return repr(name) if len(name) <= 100 else repr(name[:100]) + f"... ({len(name)} characters)"


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 (wrapping arithmetic): a bijection that spreads every bit."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64, copy=True)
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def as_u64(keys: np.ndarray | torch.Tensor) -> np.ndarray:
    """Keys as uint64 (int64 keys read as their two's-complement bits: -1 is 2**64-1)."""
    a = keys.detach().cpu().numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    if a.dtype not in (np.int64, np.uint64):
        raise ValueError(f"keys must be int64 or uint64, got {a.dtype}")
    return a.reshape(-1).view(np.uint64)


def hash_key(value: Any) -> int:
    """A 64-bit key for any str, bytes or int (``keys="hash"`` tables): BLAKE2b of its text, 8 bytes."""
    data = value if isinstance(value, bytes) else str(value).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard that holds each uint64 key."""
    owners: np.ndarray = (mix64(keys) % np.uint64(num_shards)).astype(np.int64)
    return owners


@dataclass(frozen=True)
class RowTableSpec:
    """Everything that defines a row table; travels in RegisterRows. ``init``: a new row's distribution
    (``{"kind": "normal", "mean": 0, "std": 1}``, ``uniform`` with ``a``, ``b``, or ``zeros``)."""

    name: str
    dim: int
    optimizer: optim.OptimizerSpec
    keys: str = "int64"
    init: dict[str, float | str] = field(default_factory=lambda: {"kind": "normal", "mean": 0.0, "std": 1.0})
    seed: int = 0
    admit: int = 0  # > 1: a row is stored once this many pushes carried its key (before: init, gradients dropped)
    expire: int = 0  # > 0: rows not pushed for this many of the table's steps are dropped

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"row table {label(self.name)}: expected a name, got an empty one")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or not 0 < self.dim <= 1 << 16:
            raise ValueError(f"row table {label(self.name)}: dim must be an int in [1, 65536], got {self.dim!r}")
        if self.keys not in KEY_KINDS:
            raise ValueError(f"row table {label(self.name)}: keys must be one of {KEY_KINDS}, got {self.keys!r}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"row table {label(self.name)}: seed must be in [0, 2**64), got {self.seed}")
        optim.check_row_optimizer(self.optimizer)
        check_init(self.name, self.init)
        for k in ("admit", "expire"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 32:
                raise ValueError(f"row table {label(self.name)}: {k} must be an int in [0, 2**32), got {v!r}")

    def to_proto(self) -> ps_pb2.RowTableSpec:
        return ps_pb2.RowTableSpec(name=self.name, dim=self.dim, keys=self.keys, optimizer=self.optimizer.to_proto(),
                                   init_json=json.dumps(self.init, sort_keys=True), seed=self.seed, admit=self.admit,
                                   expire=self.expire)

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON-able values (in a checkpoint's meta); ``from_json`` reads it back."""
        return {"name": self.name, "dim": self.dim, "keys": self.keys, "optimizer": self.optimizer.name,
                "params": self.optimizer.params(), "init": self.init, "seed": self.seed, "admit": self.admit,
                "expire": self.expire}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RowTableSpec:
        opt = ps_pb2.OptimizerSpec(name=d["optimizer"], params_json=json.dumps(d["params"]))
        return cls.from_proto(ps_pb2.RowTableSpec(name=d["name"], dim=d["dim"], keys=d["keys"], optimizer=opt,
                                                  init_json=json.dumps(d["init"]), seed=d["seed"],
                                                  admit=d.get("admit", 0), expire=d.get("expire", 0)))

    @classmethod
    def from_proto(cls, msg: ps_pb2.RowTableSpec) -> RowTableSpec:
        """Parse and validate; ValueError naming what is wrong."""
        init: Any = {"kind": "normal", "mean": 0.0, "std": 1.0}
        try:
            init = json.loads(msg.init_json) if msg.init_json else init
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"row table {label(msg.name)}: init_json is not valid JSON: {type(e).__name__}") from None
        return cls(name=msg.name, dim=msg.dim, optimizer=optim.spec_from_proto(msg.optimizer), keys=msg.keys,
                   init=init, seed=msg.seed, admit=msg.admit, expire=msg.expire)


def check_init(table: str, init: Any) -> None:
    if not isinstance(init, dict) or init.get("kind") not in INIT_KINDS:
        raise ValueError(f"row table {label(table)}: init must be a dict with kind in {INIT_KINDS}, got {init!r}")
    allowed = {"normal": {"mean", "std"}, "uniform": {"a", "b"}, "zeros": set()}[str(init["kind"])]
    extra = sorted(set(init) - allowed - {"kind"})
    if extra:
        raise ValueError(f"row table {label(table)}: init {init['kind']!r} takes {sorted(allowed)}, got also {extra}")
    for k in allowed & set(init):
        v = init[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"row table {label(table)}: init {k} must be a finite number, got {v!r}")


def _table_seed(spec: RowTableSpec) -> int:
    digest = hashlib.blake2b(spec.name.encode(), digest_size=8).digest()
    mixed = mix64(np.array([spec.seed ^ int.from_bytes(digest, "little")], dtype=np.uint64))
    return int(mixed[0])


def _bits(keys: np.ndarray, salt: np.uint64, dim: int) -> np.ndarray:
    """[len(keys), dim] uint64 hashes, one per (key, column), from the key's bits alone."""
    with np.errstate(over="ignore"):
        base = mix64(keys ^ salt)[:, None] + np.arange(dim, dtype=np.uint64)[None, :] * _GOLDEN
    return mix64(base)


def _unit(bits: np.ndarray) -> np.ndarray:
    """32-bit halves of hashes as float64 uniforms in (0, 1)."""
    u: np.ndarray = (bits.astype(np.float64) + 0.5) * (1.0 / (1 << 32))
    return u


def init_rows(spec: RowTableSpec, keys: np.ndarray) -> torch.Tensor:
    """The first value of the rows of uint64 ``keys``: [len(keys), dim] fp32, from (seed, name, key) alone.

    One 64-bit hash per (key, column); its two 32-bit halves are the uniforms of a Box-Muller normal
    (``uniform``: the high half)."""
    n, dim, kind = len(keys), spec.dim, spec.init["kind"]
    if kind == "zeros" or n == 0:
        return torch.zeros(n, dim)
    bits = _bits(keys, np.uint64(_table_seed(spec)), dim)
    u1 = _unit(bits >> np.uint64(32))
    if kind == "uniform":
        a, b = float(spec.init.get("a", -1.0)), float(spec.init.get("b", 1.0))
        return torch.from_numpy(a + (b - a) * u1).float()
    u2 = _unit(bits & np.uint64(0xFFFFFFFF))
    np.log(u1, out=u1)
    u1 *= -2.0
    np.sqrt(u1, out=u1)
    u2 *= 2.0 * math.pi
    np.cos(u2, out=u2)
    u1 *= u2  # Box-Muller: sqrt(-2 ln u1) cos(2 pi u2)
    z = torch.from_numpy(u1).float()
    return z.mul_(float(spec.init.get("std", 1.0))).add_(float(spec.init.get("mean", 0.0)))


def rows_per_message(dim: int, chunk_bytes: int) -> int:
    """How many rows (key + fp32 gradient, or an fp32 row) one message carries within ``chunk_bytes``."""
    return max(1, chunk_bytes // (dim * ROW_ITEMSIZE + 8))
