"""Pull responses framed from one version's weights, shared by the Pulls that ask the same.

``frame`` turns the parts of some tensors into (name, offset, dtype,
payload) items, a payload being either raw chunk bytes or, for
``messages=True``, a whole serialized ``PullResponse``. ``PullCache`` keeps
the framed responses of the current version by weak reference: the Pulls of
that version answered while another one still streams them (under bsp every
worker's, at once after the barrier) share one copy, which lives only as
long as some Pull sends it. The store clears it whenever the weights or the
version change. No lock of its own: called under the store's lock.
``ReadMixin`` is the part of ``ShardStore`` that reads its weights
(``read``, ``export_state``, ``weights``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardps.protos import codec, framing, shm
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import InvalidArgument
from shardps.server.table import TensorEntry, TensorTable

if TYPE_CHECKING:
    from shardps.server.membership import Membership
    from shardps.server.remedies import Remedy

Item = tuple[str, int, int, bytes]  # (tensor name, offset, wire dtype, payload)
Key = tuple[Any, ...]


class _Framed(list):  # type: ignore[type-arg]
    """A list of framed Pull responses that the store can refer to weakly."""

    __slots__ = ("__weakref__",)


class PullCache:
    def __init__(self) -> None:
        self._framed: dict[Key, tuple[weakref.ref[_Framed], int]] = {}
        self.hits_total = 0

    def clear(self) -> None:
        self._framed.clear()

    def get(self, key: Key) -> tuple[list[Item], int] | None:
        """The responses framed for ``key`` and their payload bytes, while some Pull still holds them."""
        ref, nbytes = self._framed.get(key, (None, 0))
        shared = ref() if ref is not None else None
        if shared is None:
            return None
        self.hits_total += 1
        return shared, nbytes

    def put(self, key: Key, out: list[Item], nbytes: int) -> None:
        self._framed = {k: v for k, v in self._framed.items() if v[0]() is not None}
        self._framed[key] = (weakref.ref(out), nbytes)  # type: ignore[arg-type]


def frame(entries: Sequence[TensorEntry], wire_dtype: int | None, chunk_bytes: int,
          header: tuple[bytes, bytes] | None) -> tuple[list[Item], int]:
    """The parts of ``entries`` as items and their payload bytes.

    ``header``: (prefix, suffix) of ``framing.pull_header``: each payload is
    then a whole PullResponse (the tensor's shape on its first chunk), and
    the list can be cached. ``wire_dtype=None``: each tensor in its
    registered dtype.
    """
    out: list[Item] = _Framed() if header is not None else []
    nbytes = 0
    for e in entries:
        dt = e.spec.dtype if wire_dtype is None else wire_dtype
        tdt = codec.to_torch_dtype(dt)
        shape: tuple[int, ...] = e.spec.shape
        for start in sorted(e.parts):
            w = e.parts[start].weight.reshape(-1)
            if tdt != torch.float32:
                w = w.to(tdt)
            if header is not None:
                prefix, suffix = header
                for off, n, msg in framing.chunk_messages(
                        prefix, framing.PULL_CHUNK_FIELD, suffix, e.spec.name, dt, shape,
                        w, 0, w.numel(), chunk_bytes, base=start):
                    out.append((e.spec.name, off, dt, msg))
                    nbytes += n
                    shape = ()
                continue
            for off, payload in codec.encode_range(w, 0, w.numel(), chunk_bytes):
                out.append((e.spec.name, start + off, dt, payload))
                nbytes += len(payload)
    return out, nbytes


class ReadMixin:
    """Read methods of ``ShardStore`` (it supplies the attributes annotated here)."""

    version: int
    membership: Membership
    pullcache: PullCache
    pull_bytes_total: int
    pulls_total: int
    _tensors: TensorTable
    _sync: SyncSpec | None
    _cond: threading.Condition

    if TYPE_CHECKING:  # the store's properties
        @property
        def loss_scale(self) -> float: ...

        @property
        def remedy(self) -> Remedy: ...

    if TYPE_CHECKING:  # the store's own methods
        def _settle(self) -> None: ...
        def spec(self, name: str) -> Any: ...
        def _remember_pulled(self, worker_id: int, names: list[str]) -> None: ...

    def read(self, names: Sequence[str], wire_dtype: int | None,
             chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, *, messages: bool = False,
             slowest_clock: int = 0, worker_id: int | None = None) -> tuple[int, list[Item]]:
        """A consistent snapshot: (version, [(name, offset, wire dtype, payload)]).

        ``wire_dtype=None`` sends each tensor in its registered dtype. The
        payloads are taken under the lock, so they all belong to ``version``.

        ``messages=True``: each payload is instead a whole serialized
        ``PullResponse`` (version, the loss scale and sync mode of that
        moment, ``slowest_clock`` as given, and the chunk, its tensor's shape
        on the tensor's first chunk), framed straight from the weights: one
        copy of the data, made once per version for all the Pulls that ask
        the same (every worker's, under bsp; see pullcache.py).
        """
        with self._cond:
            self._settle()
            entries = [self._tensors.get(n) for n in names]
            for n, e in zip(names, entries):
                if e is None:
                    self.spec(n)  # raises NotFound
            if self.remedy.kind == "dc-asgd" and worker_id is not None and worker_id in self.membership.workers:
                self._remember_pulled(worker_id, list(names))
            header = None
            if messages:
                key = (tuple(names), wire_dtype, chunk_bytes, slowest_clock, self.loss_scale, str(self._sync or ""))
                hit = self.pullcache.get(key)
                if hit is not None:
                    self.pull_bytes_total += hit[1]
                    self.pulls_total += 1
                    return self.version, hit[0]
                header = framing.pull_header(self.version, self.loss_scale, str(self._sync or ""), slowest_clock)
            out, nbytes = frame(entries, wire_dtype, chunk_bytes, header)  # type: ignore[arg-type]
            self.pull_bytes_total += nbytes
            self.pulls_total += 1
            if messages:
                self.pullcache.put(key, out, nbytes)
            return self.version, out

    def read_into(self, names: Sequence[str], wire_dtype: int | None, segment: shm.Segment, *,
                  slowest_clock: int = 0, worker_id: int | None = None) -> tuple[int, list[Item]]:
        """As ``read(messages=True)``, for the same-host fast path: the parts are copied (cast to the wire
        dtype) into ``segment``, one after another from offset 0 (each on a 64-byte boundary), under the
        lock (one version); each item's payload is a PullResponse whose chunk says where its part lies
        (``shm_offset``, ``shm_bytes``) and carries no data. INVALID_ARGUMENT when the segment is too small.
        """
        with self._cond:
            self._settle()
            entries = [self._tensors.get(n) for n in names]
            for n, e in zip(names, entries):
                if e is None:
                    self.spec(n)  # raises NotFound
            if self.remedy.kind == "dc-asgd" and worker_id is not None and worker_id in self.membership.workers:
                self._remember_pulled(worker_id, list(names))
            layout: list[tuple[TensorEntry, int, int, int, int]] = []  # (entry, part start, dtype, offset, bytes)
            at = 0
            for e in entries:
                assert e is not None
                dt = e.spec.dtype if wire_dtype is None else wire_dtype
                itemsize = codec.itemsize(dt)
                for start in sorted(e.parts):
                    nbytes = e.parts[start].weight.numel() * itemsize
                    layout.append((e, start, dt, at, nbytes))
                    at = shm.aligned(at + nbytes)
            if layout and layout[-1][3] + layout[-1][4] > segment.size:
                raise InvalidArgument(f"Pull: shared-memory segment {segment.name} holds {segment.size} bytes; "
                                      f"the weights asked need {layout[-1][3] + layout[-1][4]}")
            out: list[Item] = []
            sync = str(self._sync or "")
            nbytes = 0
            for e, start, dt, off, size in layout:
                w = e.parts[start].weight.reshape(-1)
                if size:
                    dst = torch.frombuffer(segment.view(off, size), dtype=codec.to_torch_dtype(dt))
                    dst.copy_(w)
                first = start == min(e.parts) if e.spec.shape else True
                msg = ps_pb2.PullResponse(
                    version=self.version, loss_scale=self.loss_scale, sync=sync, slowest_clock=slowest_clock,
                    chunk=ps_pb2.Chunk(name=e.spec.name, offset=start, dtype=dt,  # type: ignore[arg-type]
                                       shape=e.spec.shape if first else (), shm_offset=off, shm_bytes=size))
                out.append((e.spec.name, start, dt, msg.SerializeToString()))
                nbytes += size
            self.pull_bytes_total += nbytes
            self.pulls_total += 1
            return self.version, out

    def export_state(self, names: Sequence[str]) -> tuple[int, list[tuple[str, int, int, str, torch.Tensor]]]:
        """A consistent copy of weights and optimizer state: (version, [(name, start, stop, key, tensor)]).

        ``key`` is "weight" for the fp32 master weights, else the optimizer
        state's own key (e.g. "exp_avg", "step").
        """
        with self._cond:
            self._settle()
            for n in names:
                self.spec(n)
            out = []
            for n in names:
                for start, part in sorted(self._tensors[n].parts.items()):
                    out.append((n, start, part.stop, "weight", part.weight.clone()))
                    for key in sorted(part.state):
                        out.append((n, start, part.stop, key, part.state[key].clone()))
            return self.version, out

    def weights(self, name: str) -> dict[int, torch.Tensor]:
        """Copies of the fp32 master weights of ``name``, by part start (for tests and tools)."""
        with self._cond:
            self._settle()
            self.spec(name)
            return {s: p.weight.clone() for s, p in self._tensors[name].parts.items()}

