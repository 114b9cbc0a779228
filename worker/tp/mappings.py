"""The operators between replicated and split activations (Megatron-LM's f and g, and their gathers).

- ``copy_to``: f, at the entry of a column-parallel layer: the identity forward, an all-reduce of the input's
  gradient backward (each rank computed the gradient of its own columns' share).
- ``reduce_from``: g, at the exit of a row-parallel layer: an all-reduce of the partial sums forward, the
  identity backward.
- ``gather_from``: the split last dimension gathered (a column-parallel layer's ``gather_output``); backward
  keeps the rank's own slice.
- ``scatter_to``: the rank's slice of a replicated last dimension (a row-parallel layer whose input is not
  parallel); backward gathers.

Written here rather than taken from torch's DTensor: a DTensor needs a ``DeviceMesh``, which needs the
default process group (``init_process_group``), and shardps keeps every group outside the default world
(``worker/groups.py``) so that a stage's pipeline and TP groups live side by side. Each function is a few
lines over ``TPGroup``'s collectives, the same on gloo and nccl.
"""

from __future__ import annotations

from typing import Any

import torch

from shardps.protos.slices import chunk_range
from shardps.worker.tp.group import TPGroup


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sizes(n: int, group: TPGroup) -> list[int]:
    return [b - a for a, b in (chunk_range(n, group.size, r) for r in range(group.size))]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return torch.cat(group.all_gather_padded(x, x.dim() - 1, _sizes(n, group)), -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        a, b = chunk_range(ctx.n, ctx.group.size, ctx.group.rank)
        return grad.narrow(-1, a, b - a).contiguous(), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[-1]
        a, b = chunk_range(ctx.n, group.size, group.rank)
        return x.narrow(-1, a, b - a).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat(ctx.group.all_gather_padded(grad, grad.dim() - 1, _sizes(ctx.n, ctx.group)), -1), None


def _apply(fn: Any, x: torch.Tensor, group: TPGroup, *more: Any) -> torch.Tensor:
    if group.size == 1:
        return x  # every operator is the identity on a group of one
    out: torch.Tensor = fn.apply(x, group, *more)
    return out


def copy_to(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _apply(_Copy, x, group)


def reduce_from(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _apply(_Reduce, x, group)


def gather_from(x: torch.Tensor, group: TPGroup, n: int) -> torch.Tensor:
    """The whole last dimension (``n`` wide) from every rank's ``torch.chunk`` slice of it."""
    return _apply(_Gather, x, group, n)


def scatter_to(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """This rank's ``torch.chunk`` slice of the last dimension."""
    return _apply(_Scatter, x, group)
