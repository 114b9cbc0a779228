"""Gradient compression with error feedback, on the worker: ``TopK``, ``PowerSGD`` and what they send.

``DistributedOptimizer(compress=TopK(0.01))`` makes a ``Compressor`` once the
tensors are registered; each push hands it the gradients of the tensors it
compresses (``compresses``) and sends, per shard, the chunks ``encode``
returns (protos/compressed.py: the encodings, which the shards check and
expand into their dense fp32 staging; everything after, the sum over
workers and the optimizer step, is unchanged). Per tensor:

- which spec: ``compress`` is a spec, for every tensor of at least
  ``DENSE_BELOW`` elements and rank >= 2 (smaller ones and biases stay
  dense: their bytes are few, their values matter), or a callable
  ``(name, tensor) -> spec`` such as ``Rules([("embed.*", Dense())],
  default=TopK(0.01))``, which is taken as it says (``Dense()`` for none);
- per part: the shard map cuts a tensor into parts, each shard's own; each
  part is compressed on its own (top-k of the part, the factors of the part's
  rows), so each shard receives only its part's values and indices;
- error feedback (on by default): a residual ``r`` per tensor; the worker
  sends ``C(g + r)`` and keeps ``r <- g + r - D(C(g + r))``, ``D`` being
  exactly the shards' expansion (protos/compressed.py's ``topk_into`` and
  ``lowrank_into``, on the values as they travel: a bf16 value's rounding
  stays in ``r`` too; ``g + r`` is formed in ``r``'s buffer and what is sent
  subtracted there). A gradient with an inf/nan is not sent (the step is
  skipped everywhere: ``found_inf``) and leaves ``r`` as it was (finite
  ``g`` and ``r`` whose sum overflows: ``r`` is dropped);
- warm-up: the first ``warmup_steps`` pushes go dense (Deep Gradient
  Compression's lesson: early gradients change fast; ``r`` stays 0).

PowerSGD with a parameter server: torch's ``powerSGD_hook`` all-reduces
``P = M Q`` between its two halves, so every worker orthogonalises the same
``P`` and the sum is one rank-r matrix. Here there is no all-reduce: each
worker computes its own ``P`` (orthogonalised) and ``Q = M^T P`` with one
power iteration warm-started from its previous ``Q``, sends both, and each
shard adds every worker's ``P Q^T``: a sum of rank-r terms (rank <= r x
workers), decoded on the shard. A part whose factors would not be smaller
than its values (``r (rows + cols) >= rows cols``), or rows < r, leaves
its tensor dense, as torch does for tensors that do not pay.

State (residuals, PowerSGD's ``Q``) lives on the gradient's device, one
fp32 residual per compressed tensor; ``reset`` drops it (a rejoin or a
rollback: the job's weights moved under it). Not thread-safe: the thread
that drives the optimizer calls it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from shardps.protos import codec, compressed
from shardps.protos.rules import Rules, max_rank
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.layout import Layout

DENSE_BELOW = 1024
"""Tensors of fewer elements stay dense under a plain ``compress=spec`` (4 KiB in fp32: a chunk's header and
indices would eat most of what compressing them saves)."""


@dataclass(frozen=True)
class Dense:
    """No compression (for a rule: ``Rules([("embed.*", Dense())], default=TopK(0.01))``)."""

    rule_kind: ClassVar[str] = "compression"
    name: ClassVar[str] = "dense"
    warmup_steps: ClassVar[int] = 0
    error_feedback: ClassVar[bool] = False


@dataclass(frozen=True)
class TopK:
    """Send the ``ratio`` of each part's elements of largest magnitude (at least one), values and indices."""

    ratio: float
    error_feedback: bool = True
    warmup_steps: int = 0
    rule_kind: ClassVar[str] = "compression"
    name: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"TopK: ratio must be in (0, 1], got {self.ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"TopK: warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class PowerSGD:
    """Send each part's rank-``rank`` factors ``P`` (rows x rank) and ``Q`` (cols x rank) of its matrix view."""

    rank: int = 4
    error_feedback: bool = True
    warmup_steps: int = 0
    rule_kind: ClassVar[str] = "compression"
    name: ClassVar[str] = "powersgd"

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= compressed.MAX_RANK:
            raise ValueError(f"PowerSGD: rank must be in [1, {compressed.MAX_RANK}], got {self.rank}")
        if self.warmup_steps < 0:
            raise ValueError(f"PowerSGD: warmup_steps must be >= 0, got {self.warmup_steps}")


Spec = Dense | TopK | PowerSGD
CompressChoice = Spec | Callable[[str, torch.Tensor], Spec]


def default_rules(spec: Spec) -> Rules[Spec]:
    """What ``compress=spec`` means: biases (rank < 2) and tensors under ``DENSE_BELOW`` elements stay dense."""
    return Rules([(max_rank(1), Dense()), (lambda _, t: t.numel() < DENSE_BELOW, Dense())], default=spec)


def parse(text: str, warmup_steps: int = 0) -> Spec:
    """``none``, ``topk:RATIO`` or ``powersgd:RANK`` (the CLI's ``--compress``)."""
    kind, _, arg = text.partition(":")
    try:
        if kind == "none" and not arg:
            return Dense()
        if kind == "topk":
            return TopK(float(arg), warmup_steps=warmup_steps)
        if kind == "powersgd":
            return PowerSGD(int(arg or 4), warmup_steps=warmup_steps)
    except ValueError as e:
        raise ValueError(f"--compress {text!r}: {e}") from None
    raise ValueError(f"--compress {text!r}: expected none, topk:RATIO or powersgd:RANK")


@dataclass(frozen=True)
class PackedChunk:
    """One compressed chunk as it will travel: its values (the data: contiguous CPU, the push dtype) and
    every other Chunk field."""

    values: torch.Tensor
    fields: dict[str, Any]

    def proto(self) -> ps_pb2.Chunk:
        return ps_pb2.Chunk(data=self.values.view(torch.uint8).numpy().tobytes(), **self.fields)


@dataclass
class Encoded:
    """One push's compressed tensors: each shard's chunks, and whether every value was finite."""

    chunks: dict[int, list[PackedChunk]] = field(default_factory=dict)
    finite: bool = True

    def of(self, shard: int) -> list[PackedChunk]:
        return self.chunks.get(shard, [])


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Compressor:
    """One worker's compression state and encoder (module docstring). ``sent``: with ``keep_sent``, each
    tensor's last push as the shards expand it (fp32, flat: for tests and diagnostics)."""

    def __init__(self, choice: CompressChoice, tensors: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout],
                 shard_map: ShardMap, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> None:
        pick = choice if callable(choice) else default_rules(choice)
        self.specs: dict[str, Spec] = {}
        self.parts: dict[str, list[tuple[int, int, int]]] = {}  # name -> (start, stop, shard)
        self.layouts = layouts
        self.chunk_bytes = chunk_bytes
        for p in shard_map.parts:
            self.parts.setdefault(p.name, []).append((p.start, p.stop, p.server))
        for name, t in tensors.items():
            spec = pick(name, t)
            if isinstance(spec, PowerSGD):
                if t.dim() < 2:
                    raise ValueError(f"compress: PowerSGD for {name!r} of shape {list(t.shape)}: it needs a matrix "
                                     f"view (rank >= 2); give it Dense() or TopK")
                if not self._pays(name, spec):
                    spec = Dense()
            if not isinstance(spec, Dense) and name in self.parts:
                self.specs[name] = spec
        self.pushes = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self.qs: dict[tuple[str, int], torch.Tensor] = {}
        self.keep_sent = False
        self.sent: dict[str, torch.Tensor] = {}

    def _pays(self, name: str, spec: PowerSGD) -> bool:
        """Every part has rank rows at least, factors smaller than its values, and Q fits half a chunk."""
        lay = self.layouts[name]
        cols, r, size = compressed.columns(lay.shape), spec.rank, codec.itemsize(lay.push_dtype)
        if cols * r * size > self.chunk_bytes // 2:
            return False
        return all((b - a) // cols >= r and r * ((b - a) // cols + cols) < b - a for a, b, _ in self.parts[name])

    def compresses(self, name: str) -> bool:
        """Whether this push sends ``name`` compressed (a compressing spec, past its warm-up)."""
        spec = self.specs.get(name)
        return spec is not None and self.pushes >= spec.warmup_steps

    def reset(self) -> None:
        """Drop the residuals and PowerSGD's factors (the pushes counted, and so the warm-up, stay)."""
        self.residuals.clear()
        self.qs.clear()
        self.sent.clear()

    def encode(self, grads: Mapping[str, torch.Tensor]) -> Encoded:
        """The chunks of ``grads`` (names it ``compresses``, registered shapes) per shard; one push counted."""
        out = Encoded()
        for name, g in grads.items():
            spec = self.specs[name]
            g = g.detach().reshape(-1)
            if not codec.all_finite(g):
                out.finite = False  # the shards skip the step: nothing to send, the residual stays
                continue
            # m = g + r, in the residual's own buffer: the encoders subtract what they send from it in place,
            # leaving the next residual (no buffer of the tensor's size allocated per push).
            m = self.residuals.get(name) if spec.error_feedback else None
            if m is None:
                m = g.to(torch.float32, copy=True)
            else:
                m.add_(g)
                if not codec.all_finite(m):  # finite values that overflowed together: the residual is lost
                    del self.residuals[name]
                    out.finite = False
                    continue
            sent = torch.zeros_like(m) if self.keep_sent else None
            for start, stop, shard in self.parts[name]:
                if isinstance(spec, TopK):
                    chunks = self._topk(name, spec, m, sent, start, stop)
                else:
                    assert isinstance(spec, PowerSGD)
                    chunks = self._lowrank(name, spec, m, sent, start, stop)
                out.chunks.setdefault(shard, []).extend(chunks)
            if spec.error_feedback:
                self.residuals[name] = m
            if sent is not None:
                self.sent[name] = sent
        self.pushes += 1
        return out

    def _topk(self, name: str, spec: TopK, m: torch.Tensor, sent: torch.Tensor | None, start: int,
              stop: int) -> list[PackedChunk]:
        """The part's chunks; ``m[start:stop]`` left less what the shards will expand (``topk_into``): the
        values as they travel taken from the elements sent, every other one as it was."""
        lay = self.layouts[name]
        dtype = codec.to_torch_dtype(lay.push_dtype)
        x, n = m[start:stop], stop - start
        k = min(n, max(1, math.ceil(spec.ratio * n)))
        if k == n:
            idx = torch.arange(n, device=m.device)
        else:
            idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        values = x[idx].to(dtype)
        x.index_put_((idx,), x[idx] - values.to(torch.float32))
        if sent is not None:
            compressed.topk_into(sent[start:stop], idx, values)
        idx, values = idx.cpu(), values.cpu()
        per = max(1, self.chunk_bytes // (dtype.itemsize + 8))  # pairs per chunk (int64 indices at most)
        out = []
        for j in range(0, k, per):
            a = start if j == 0 else start + int(idx[j])
            b = stop if j + per >= k else start + int(idx[j + per])
            rel = idx[j : j + per] + (start - a)
            out.append(PackedChunk(values[j : j + per].contiguous(), dict(
                name=name, offset=a, dtype=lay.push_dtype, shape=lay.shape if j == 0 else (),
                encoding=compressed.TOPK, numel=b - a, indices=_bytes(rel.to(compressed.index_dtype(b - a))))))
        return out

    def _lowrank(self, name: str, spec: PowerSGD, m: torch.Tensor, sent: torch.Tensor | None, start: int,
                 stop: int) -> list[PackedChunk]:
        """The part's chunks; ``m[start:stop]`` left less ``P Q^T`` as the shards will expand it, chunk by chunk
        (``lowrank_into``)."""
        lay = self.layouts[name]
        dtype = codec.to_torch_dtype(lay.push_dtype)
        cols, rank = compressed.columns(lay.shape), spec.rank
        rows = (stop - start) // cols
        mat = m[start:stop].view(rows, cols)
        q = self.qs.get((name, start))
        if q is None:  # the same start on every run: seeded by the tensor's name and the part
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{start}".encode()))
            q = torch.randn(cols, rank, generator=gen).to(m.device)
        p = torch.linalg.qr(mat @ q).Q  # one power iteration from the previous Q, P orthonormal
        q = mat.T @ p
        self.qs[(name, start)] = q
        ps, qs = p.to(dtype).contiguous(), q.to(dtype).contiguous()
        factor = _bytes(qs.cpu())
        per = max(1, (self.chunk_bytes - len(factor)) // (rank * dtype.itemsize))  # rows of P per chunk
        out = []
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            approx = torch.empty((r1 - r0) * cols, dtype=torch.float32, device=m.device)
            compressed.lowrank_into(approx, ps[r0:r1], qs)
            m[start + r0 * cols : start + r1 * cols].sub_(approx)
            if sent is not None:
                sent[start + r0 * cols : start + r1 * cols] = approx
            out.append(PackedChunk(ps[r0:r1].reshape(-1).cpu(), dict(
                name=name, offset=start + r0 * cols, dtype=lay.push_dtype, shape=lay.shape if r0 == 0 else (),
                encoding=compressed.LOWRANK, numel=(r1 - r0) * cols, rank=rank, factor=factor)))
        return out
