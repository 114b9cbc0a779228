"""A Push carrying slices (``PushRequest.slices``): each of those tensors' gradient as one slice, put in place.

A tensor-parallel rank pushes its slice ``torch.chunk(g, p, dim)[rank]`` of a whole gradient ``g``
(docs/tensor-parallel.md; protos/slices.py). Its chunks' offsets and shape are the slice's: the assembly
(server/datapath/assembly.py) checks them against the slice as this shard holds it (``SlicedLookup``: a spec whose
shape is the slice's and whose parts are the slice's runs in this shard's parts), so a chunk outside the
slice, a missing or overlapping element, a wrong dtype or shape is refused as for any Push. ``place`` then
writes each run into its place in a zero-filled buffer of the whole part (``TensorSlice.put``): the other
ranks' slices of the same step fill the rest, summed by the barrier (server/sync.py) into the part's
gradient, which is stepped once all are in, as one whole gradient would be (adding a slice's zeros changes
no element: x + 0 = x).

The barrier averages a part over the gradients it got; each data-parallel replica sends a part p slices,
which together are one gradient. So each slice says how many gradients it counts for (``weights``): the one
holding the part's first element 1, the others 0, so that a part counts one per replica as a whole push
does. A slice that does not fit its tensor is INVALID_ARGUMENT (``check_slice``); a slice under a sync mode
without a barrier (asp, ssp: each push stepped alone would move the rest of the part with a zero
gradient) is FAILED_PRECONDITION (server/datapath/path.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from shardps.protos.slices import TensorSlice
from shardps.server.datapath.slicepull import check_slice
from shardps.server.errors import InvalidArgument
from shardps.server.sync import Grad, PartKey
from shardps.server.table import TensorSpec


class SlicedLookup:
    """``lookup`` (the shard's spec of a tensor) with each sliced tensor's spec as its slice here."""

    def __init__(self, lookup: Callable[[str], TensorSpec], slices: Mapping[str, TensorSlice]) -> None:
        self._lookup = lookup
        self.slices = dict(slices)
        self.whole: dict[str, TensorSpec] = {}  # the sliced tensors' own specs, as they were looked up

    def __call__(self, name: str) -> TensorSpec:
        spec = self._lookup(name)  # NotFound for a tensor not held
        sl = self.slices.get(name)
        if sl is None:
            return spec
        check_slice("Push", spec, sl)
        runs = tuple((at, at + n) for a, b in spec.parts for at, n, _ in sl.pieces(spec.shape, a, b))
        if not runs:
            raise InvalidArgument(f"Push: tensor {name!r}: the slice (dim {sl.dim}, parts {sl.parts}, index "
                                  f"{sl.index}) has no elements on this shard (expected no chunks), got some")
        self.whole[name] = spec
        return dataclasses.replace(spec, shape=sl.shape(spec.shape), parts=runs, peers=(), holders=())

    def place(self, grads: Mapping[PartKey, Grad]) -> tuple[dict[PartKey, Grad], dict[PartKey, int]]:
        """The assembled gradients with each sliced tensor's runs put into zero-filled buffers of its parts,
        and how many gradients each such part counts for (see the module docstring)."""
        out = {key: g for key, g in grads.items() if key[0] not in self.whole}
        weights: dict[PartKey, int] = {}
        for name, spec in self.whole.items():
            sl = self.slices[name]
            for a, b in spec.parts:
                pieces = sl.pieces(spec.shape, a, b)
                if not pieces:
                    continue
                runs = []
                for at, _, _ in pieces:
                    g = grads[(name, at)]
                    assert isinstance(g, torch.Tensor), "a sliced Push is assembled into fp32 buffers"
                    runs.append(g)
                buf = torch.zeros(b - a, dtype=torch.float32)
                sl.put(spec.shape, a, buf, runs)
                out[(name, a)] = buf
                weights[(name, a)] = 1 if sl.holds(spec.shape, a) else 0
        return out, weights
