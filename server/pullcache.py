"""Pull responses framed from one version's weights, shared by the Pulls that ask the same.

``frame`` turns the parts of some tensors into (name, offset, dtype,
payload) items, a payload being either raw chunk bytes or, for
``messages=True``, a whole serialized ``PullResponse``. ``PullCache`` keeps
the framed responses of the current version by weak reference: the Pulls of
that version answered while another one still streams them (under bsp every
worker's, at once after the barrier) share one copy, which lives only as
long as some Pull sends it. The store clears it whenever the weights or the
version change. No lock of its own: called under the store's lock.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from shardps.protos import codec, framing
from shardps.server.table import TensorEntry

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
