"""A slice of a whole tensor as a Pull names it (``PullRequest.slices``): what the shard and the worker agree on.

``TensorSlice(dim, parts, index, blocks)`` is ``torch.chunk(t, parts, dim)[index]``: along ``dim``, elements
``[index * c, min((index + 1) * c, n))`` with ``c = ceil(n / parts)`` (empty where ``torch.chunk`` returns
fewer than ``parts`` chunks). With ``blocks > 1`` the tensor is first cut into that many equal blocks along
``dim``, each chunked so, and the ``index``-th chunks of the blocks are joined along ``dim`` (attention's fused
query, key and value projection: every tensor-parallel rank holds whole heads of each). Both sides know a
slice from these four numbers alone.

A shard holds a tensor's parts (protos/shardmap.py: row blocks for rank >= 2, flat ranges for vectors), and
answers a sliced Pull with the slice's elements its parts hold: ``pieces`` says where they lie in the part's
flat elements and in the slice's. Along dim 0 those are flat ranges of the part; along a later dim every row
of the part holds some, gathered by the shard (``take``) into one run of the slice's rows, so the worker
never receives a whole row. A sliced Push (``PushRequest.slices``) goes the other way: the shard writes each
run into its place in the part (``put``), and counts the slice holding the part's first element
(``holds``) as the one whole contribution of its group of slices to that part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of ``torch.chunk(range(n), parts)[index]`` (empty where that chunk does not exist)."""
    c = math.ceil(n / parts) if n else 0
    start = min(index * c, n)
    return start, min(start + c, n)


@dataclass(frozen=True)
class TensorSlice:
    """``torch.chunk(t, parts, dim)[index]`` of a whole tensor (of each of ``blocks`` equal blocks along dim)."""

    dim: int
    parts: int
    index: int
    blocks: int = 1

    def problem(self, shape: tuple[int, ...]) -> str:
        """What is wrong with this slice of a tensor of ``shape`` ("" when nothing): the expected and the
        received, for an INVALID_ARGUMENT message."""
        if not shape:
            return f"a tensor of shape [] has no dimension to slice, got dim {self.dim}"
        if not 0 <= self.dim < len(shape):
            return f"dim must be in [0, {len(shape)}) for shape {list(shape)}, got {self.dim}"
        if self.parts < 1:
            return f"parts must be >= 1, got {self.parts}"
        if not 0 <= self.index < self.parts:
            return f"index must be in [0, {self.parts}) for parts {self.parts}, got {self.index}"
        if self.blocks < 1 or shape[self.dim] % self.blocks:
            return (f"blocks must be >= 1 and divide dimension {self.dim} (size {shape[self.dim]}) into equal "
                    f"blocks, got {self.blocks}")
        return ""

    def ranges(self, n: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges along ``dim`` (of size ``n``) the slice takes, one per block."""
        block = n // self.blocks
        out = []
        for k in range(self.blocks):
            a, b = chunk_range(block, self.parts, self.index)
            out.append((k * block + a, k * block + b))
        return out

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        """The slice's shape, of a tensor of shape ``whole``."""
        out = list(whole)
        out[self.dim] = sum(b - a for a, b in self.ranges(whole[self.dim]))
        return tuple(out)

    def pieces(self, whole: tuple[int, ...], start: int, stop: int) -> list[tuple[int, int, int]]:
        """The slice's elements in the flat part ``[start, stop)`` of the whole tensor: ``(slice offset,
        numel, part offset)`` runs, in order. Along dim 0 each run is ``numel`` consecutive elements of the
        part from ``part offset``; along a later dim there is one run (``part offset`` -1), the part's rows
        narrowed to the slice's ranges (``take``): the part must then be whole units of ``whole[dim:]``
        (protos/shardmap.py cuts row blocks), ValueError otherwise."""
        inner = math.prod(whole[self.dim + 1:])
        out = []
        if self.dim == 0:
            at = 0
            for a, b in self.ranges(whole[0]):
                lo, hi = max(start, a * inner), min(stop, b * inner)
                if lo < hi:
                    out.append((at + lo - a * inner, hi - lo, lo - start))
                at += (b - a) * inner
            return out
        unit = whole[self.dim] * inner
        if unit == 0 or start % unit or stop % unit:
            raise ValueError(f"elements [{start}, {stop}) are not whole units of {unit} (dims {self.dim}..)")
        width = sum(b - a for a, b in self.ranges(whole[self.dim])) * inner
        n = (stop - start) // unit * width
        return [(start // unit * width, n, -1)] if n else []

    def take(self, whole: tuple[int, ...], start: int, flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The slice's elements in the part ``flat`` (elements ``[start, start + numel)`` of the whole
        tensor): ``(slice offset, contiguous 1-D copy)`` per run of ``pieces``."""
        out = []
        for at, n, off in self.pieces(whole, start, start + flat.numel()):
            if off >= 0:
                out.append((at, flat[off : off + n].clone()))
                continue
            inner = math.prod(whole[self.dim + 1:])
            rows = flat.view(-1, whole[self.dim], inner)
            got = torch.cat([rows[:, a:b] for a, b in self.ranges(whole[self.dim])], dim=1)
            out.append((at, got.reshape(-1)))
        return out

    def put(self, whole: tuple[int, ...], start: int, flat: torch.Tensor, runs: list[torch.Tensor]) -> None:
        """``take``'s inverse: the slice's ``runs`` (one 1-D tensor per run of ``pieces``, in order) written
        into their places in the part ``flat`` (elements ``[start, start + numel)`` of the whole tensor)."""
        for (_, n, off), values in zip(self.pieces(whole, start, start + flat.numel()), runs):
            if off >= 0:
                flat[off : off + n].copy_(values)
                continue
            inner = math.prod(whole[self.dim + 1:])
            rows = flat.view(-1, whole[self.dim], inner)
            got = values.view(rows.shape[0], -1, inner)
            at = 0
            for a, b in self.ranges(whole[self.dim]):
                rows[:, a:b].copy_(got[:, at : at + b - a])
                at += b - a

    def holds(self, whole: tuple[int, ...], element: int) -> bool:
        """Whether the flat element ``element`` of the whole tensor lies in the slice."""
        inner = math.prod(whole[self.dim + 1:])
        j = (element // inner) % whole[self.dim] if inner and whole[self.dim] else 0
        return any(a <= j < b for a, b in self.ranges(whole[self.dim]))
