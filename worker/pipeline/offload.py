"""Activation offload: what a stage saves for backward goes to a store, and comes back before its backward.

Rides on ``torch.autograd.graph.saved_tensors_hooks``: ``pack`` takes each
saved tensor (not the stage's parameters, not tiny ones) and keeps only a
key; when the micro-batch's forward ends, all it saved goes to a ``Sink`` as
one bundle, in one transfer, and the backward gets the bundle back in one
(``unpack`` takes each tensor from it). A tensor saved twice (a ReLU's output
that the next Linear saves too) is stored once. The sink is an interface:
``LocalSink`` keeps a dict (tests, one process); on Ray it is a connection
to the offload store actor (``SocketSink``, worker/pipeline/offloadwire.py;
shardps.deploy.ray.stage_actor), its transfers made in the background, with
``prefetch`` fetching a micro-batch's bundle ahead of the backward that needs
it.

Encodings of what is stored (Gist, Jain et al. 2018):

- ``"bf16"`` / ``"fp16"``: delayed precision reduction. fp32 activations
  are stored in half precision and widened again for the backward. Lossy:
  the gradients differ from the exact ones by about the half type's
  rounding (docs/pipeline.md has the measured error).
- ``"relu-mask"``: lossless. The stage's ``nn.ReLU`` layers are replaced by
  ``MaskReLU``, whose backward needs only where the output was positive: it
  saves one bit per element instead of the fp32 output.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from shardps.worker.pipeline.names import ENCODINGS

MIN_OFFLOAD_ELEMENTS = 1024  # smaller saved tensors stay: a round trip costs more than they hold


class Sink(Protocol):
    """Where offloaded tensors live between a forward and its backward: one bundle (key -> encoded
    tensor) per micro-batch, named ``group``. ``put`` may return before the bundle has arrived; a later
    ``prefetch``/``get`` of the same group still finds it."""

    def put(self, group: str, values: dict[str, Any]) -> None: ...

    def prefetch(self, group: str) -> None: ...

    def get(self, group: str) -> dict[str, Any]: ...

    def drop(self, group: str) -> None: ...


class LocalSink:
    """A dict: offload within one process (tests, the bytes a store would hold)."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Any]] = {}

    def put(self, group: str, values: dict[str, Any]) -> None:
        self.data[group] = values

    def prefetch(self, group: str) -> None:
        pass

    def get(self, group: str) -> dict[str, Any]:
        return self.data[group]

    def drop(self, group: str) -> None:
        self.data.pop(group, None)


def check_compress(compress: str | Iterable[str] | None) -> tuple[str, ...]:
    if compress is None:
        return ()
    items = (compress,) if isinstance(compress, str) else tuple(compress)
    bad = [c for c in items if c not in ENCODINGS]
    if bad:
        raise ValueError(f"compress: unknown encodings {bad}; known: {', '.join(ENCODINGS)}")
    if "bf16" in items and "fp16" in items:
        raise ValueError("compress: bf16 or fp16, not both")
    return items


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements per byte (any device)."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    bits = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=packed.device)
    return (packed.view(-1, 1) & bits).ne(0).view(-1)[:numel]


class _MaskReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.clamp_min(0)
        ctx.shape, ctx.numel = y.shape, y.numel()
        ctx.save_for_backward(pack_bits(y > 0))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (packed,) = ctx.saved_tensors
        return grad * unpack_bits(packed, ctx.numel).view(ctx.shape).to(grad.dtype)


class MaskReLU(nn.Module):
    """``nn.ReLU`` that saves 1 bit per element for its backward instead of its fp32 output (lossless)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _MaskReLUFn.apply(x)  # type: ignore[no-untyped-call]
        return out


def use_mask_relu(module: nn.Module) -> int:
    """Replace every ``nn.ReLU`` inside ``module`` by ``MaskReLU``; how many were replaced."""
    n = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.ReLU:
            setattr(module, name, MaskReLU())
            n += 1
        else:
            n += use_mask_relu(child)
    return n


@dataclass
class OffloadStats:
    """Bytes of one stage's saved activations: held locally and stored, and their peaks."""

    held_bytes: int = 0  # saved tensors kept in the stage's memory now
    peak_held_bytes: int = 0
    stored_bytes: int = 0  # what the sink holds for this stage now
    peak_stored_bytes: int = 0
    stored_total: int = 0  # bytes sent to the sink this step
    raw_total: int = 0  # the same tensors' bytes before encoding

    def reset_step(self) -> None:
        self.stored_total = self.raw_total = 0
        self.peak_held_bytes, self.peak_stored_bytes = self.held_bytes, self.stored_bytes


@dataclass
class Offloader:
    """The saved-tensor hooks of one stage: ``hooks(mb)`` for a micro-batch's forward."""

    sink: Sink | None  # None: keep everything (only count it)
    params: set[int]  # storage pointers of the stage's parameters: never offloaded
    compress: tuple[str, ...] = ()
    prefix: str = ""  # keeps keys of stages that share one store apart
    min_elements: int = MIN_OFFLOAD_ELEMENTS
    stats: OffloadStats = field(default_factory=OffloadStats)
    _groups: dict[int, str] = field(default_factory=dict)  # micro-batch -> the name of its stored bundle
    _fetched: dict[int, dict[str, Any]] = field(default_factory=dict)  # micro-batch -> its bundle, back
    _held: dict[int, int] = field(default_factory=dict)  # micro-batch -> bytes kept locally
    _sizes: dict[int, int] = field(default_factory=dict)  # micro-batch -> bytes stored
    _counter: Any = field(default_factory=itertools.count)

    @contextlib.contextmanager
    def hooks(self, mb: int) -> Iterator[None]:
        """Offload what micro-batch ``mb``'s forward saves for its backward, while the context lasts: as
        one bundle, put when it ends.

        A tensor saved twice is stored once: it is recognised by its memory,
        so every stored tensor is kept alive until the forward ends (freed
        earlier, its memory could hold another tensor by then).
        """
        seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], tuple[Any, torch.Tensor]] = {}
        bundle: dict[str, Any] = {}

        def pack(t: torch.Tensor) -> Any:
            nbytes = t.numel() * t.element_size()
            try:
                storage = t.untyped_storage().data_ptr()
            except RuntimeError:  # a tensor without storage (sparse, ...): keep it
                storage = -1
            if self.sink is None or storage in self.params or t.numel() < self.min_elements or t.is_sparse:
                if storage not in self.params:
                    self._hold(mb, nbytes)
                return ("keep", t)
            ident = (storage, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
            if ident in seen:  # saved twice (an output that the next layer saves as its input)
                return seen[ident][0]
            key = str(len(bundle))
            value = self._encode(t)
            stored = value[0].numel() * value[0].element_size()
            bundle[key] = value
            self._sizes[mb] = self._sizes.get(mb, 0) + stored
            s = self.stats
            s.stored_bytes += stored
            s.peak_stored_bytes = max(s.peak_stored_bytes, s.stored_bytes)
            s.stored_total += stored
            s.raw_total += nbytes
            seen[ident] = (("off", mb, key), t)
            return seen[ident][0]

        def unpack(packed: Any) -> torch.Tensor:
            if packed[0] == "keep":
                return packed[1]  # type: ignore[no-any-return]
            _, owner, key = packed
            if owner == mb and key in bundle:  # unpacked within its own forward: not sent yet
                return self._decode(bundle[key])
            return self._decode(self._bundle(owner)[key])

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            seen.clear()
        if bundle and self.sink is not None:
            group = f"{self.prefix}{mb}/{next(self._counter)}"
            self._groups[mb] = group
            self.sink.put(group, dict(bundle))
            bundle.clear()

    def _hold(self, mb: int, nbytes: int) -> None:
        self._held[mb] = self._held.get(mb, 0) + nbytes
        self.stats.held_bytes += nbytes
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self.stats.held_bytes)

    def _encode(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype, torch.device]:
        data = t.detach()
        if t.dtype == torch.float32 and "bf16" in self.compress:
            data = data.to(torch.bfloat16)
        elif t.dtype == torch.float32 and "fp16" in self.compress:
            data = data.to(torch.float16)
        return data.to("cpu", copy=data.device.type == "cpu" and data.dtype == t.dtype), t.dtype, t.device

    @staticmethod
    def _decode(value: tuple[torch.Tensor, torch.dtype, torch.device]) -> torch.Tensor:
        data, dtype, device = value
        return data.to(device=device, dtype=dtype)

    def _bundle(self, mb: int) -> dict[str, Any]:
        if mb not in self._fetched:
            assert self.sink is not None
            self._fetched[mb] = self.sink.get(self._groups[mb])
        return self._fetched[mb]

    def group(self, mb: int) -> str | None:
        """The name of micro-batch ``mb``'s stored bundle (None: it stored nothing)."""
        return self._groups.get(mb)

    def release(self, mb: int) -> None:
        """The backward of ``mb`` is done: its stored tensors and its held bytes are gone."""
        group = self._groups.pop(mb, None)
        self._fetched.pop(mb, None)
        self.stats.stored_bytes -= self._sizes.pop(mb, 0)
        if group is not None and self.sink is not None:
            self.sink.drop(group)
        self.stats.held_bytes -= self._held.pop(mb, 0)
