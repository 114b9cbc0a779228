"""Tensor-parallel layers (Megatron-LM's column, row and vocabulary splits) and a GPT block's parts.

Each layer holds its rank's ``torch.chunk`` slice of the dense layer's parameters under the dense names
(``weight``, ``bias``), and says in ``tp_params`` which are split, how (``Slice``), and the whole tensor's
shape; a parameter not listed there is replicated (the same on every rank). A layer built directly
initialises the whole dense tensor from the default random stream (as ``nn.Linear`` / ``nn.Embedding``
would) and keeps its slice, so the model is the same at every TP size for the same seed; ``from_dense``
slices an existing layer. ``group`` is a ``TPGroup`` (None: the group of one rank).

- ``ColumnParallelLinear``: the weight's rows (dim 0, the output features) and the bias split; the input is
  replicated (f before), the output split (or gathered with ``gather_output``).
- ``RowParallelLinear``: the weight's columns (dim 1) split, the bias replicated and added after the
  all-reduce of the partial products (g).
- ``VocabParallelEmbedding``: the table's rows split; ids outside the rank's rows give zeros; g sums.
- ``ParallelSelfAttention`` (causal, heads split: the fused q/k/v projection by columns, three parts, the
  output projection by rows) and ``ParallelMLP`` (column, GELU, row): two all-reduces forward and two backward
  per block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from shardps.protos.slices import chunk_range
from shardps.worker.tp.group import GroupLike, Slice, TPGroup, as_group
from shardps.worker.tp.mappings import copy_to, gather_from, reduce_from, scatter_to

TPParams = dict[str, tuple[Slice, tuple[int, ...]]]


def _group(group: GroupLike) -> TPGroup:
    return as_group(group, "tp layer: group")


def _param(full: torch.Tensor, sl: Slice, group: TPGroup) -> nn.Parameter:
    return nn.Parameter(sl.take(full.detach(), group.size, group.rank), requires_grad=full.requires_grad)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s rows and ``b`` split: each rank computes its slice of the outputs.
    ``parts``: the output is ``parts`` equal blocks each split on its own (3 for a fused q/k/v)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: GroupLike = None, *, parts: int = 1, dense: nn.Linear | None = None) -> None:
        super().__init__()
        self.group = _group(group)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        if gather_output and parts != 1:
            raise ValueError("ColumnParallelLinear: gather_output needs parts=1")
        dense = dense if dense is not None else nn.Linear(in_features, out_features, bias)
        self.tp_params: TPParams = {"weight": (Slice(0, parts), (out_features, in_features))}
        self.weight = _param(dense.weight, Slice(0, parts), self.group)
        if dense.bias is not None:
            self.tp_params["bias"] = (Slice(0, parts), (out_features,))
            self.bias: nn.Parameter | None = _param(dense.bias, Slice(0, parts), self.group)
        else:
            self.bias = None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: GroupLike, *, gather_output: bool = False,
                   parts: int = 1) -> ColumnParallelLinear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                   parts=parts, dense=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to(x, self.group), self.weight, self.bias)
        return gather_from(y, self.group, self.out_features) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.group.size}"


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s columns split: each rank multiplies its slice of the input features,
    the partial products are summed over the group (g), then the replicated bias is added."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: GroupLike = None, *, dense: nn.Linear | None = None) -> None:
        super().__init__()
        self.group = _group(group)
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        dense = dense if dense is not None else nn.Linear(in_features, out_features, bias)
        self.tp_params: TPParams = {"weight": (Slice(1), (out_features, in_features))}
        self.weight = _param(dense.weight, Slice(1), self.group)
        self.bias = nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: GroupLike, *,
                   input_is_parallel: bool = True) -> RowParallelLinear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                   dense=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, self.group)
        y = reduce_from(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.group.size}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose table's rows (the vocabulary) are split; any vocabulary size (``torch.chunk``'s
    slices: the last rank's may be shorter, or empty)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: GroupLike = None, *,
                 padding_idx: int | None = None, dense: nn.Embedding | None = None) -> None:
        super().__init__()
        self.group = _group(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        dense = dense if dense is not None else nn.Embedding(num_embeddings, embedding_dim, padding_idx)
        self.tp_params: TPParams = {"weight": (Slice(0), (num_embeddings, embedding_dim))}
        self.weight = _param(dense.weight, Slice(0), self.group)
        self.start, self.end = chunk_range(num_embeddings, self.group.size, self.group.rank)
        # As nn.Embedding's: the padding row gets no gradient (on the rank whose rows hold it).
        self.padding_idx = dense.padding_idx
        pad = self.padding_idx
        self._local_pad = pad - self.start if pad is not None and self.start <= pad < self.end else None

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: GroupLike) -> VocabParallelEmbedding:
        """``emb`` split; refused (``ValueError``) where ``emb`` has an option the split layer would drop."""
        check_embedding("VocabParallelEmbedding", emb)
        return cls(emb.num_embeddings, emb.embedding_dim, group, dense=emb)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        if self.end == self.start:
            y = self.weight.sum() * 0 + ids.new_zeros(*ids.shape, self.embedding_dim, dtype=self.weight.dtype)
        else:
            y = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight, self._local_pad)
            y = y * (~outside).unsqueeze(-1).to(y.dtype)
        return reduce_from(y, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.end}), tp={self.group.size}"


class RNGTracker:
    """Megatron's RNG tracker: dropout on replicated activations draws from the default stream (the same
    on every rank of a group that seeded it the same), dropout on split activations from a stream of this
    rank's own (``seed + 2718 + rank``) inside ``fork()``, so that the ranks' masks differ."""

    def __init__(self, seed: int, rank: int) -> None:
        self.generator = torch.Generator().manual_seed(seed + 2718 + rank)

    @contextmanager
    def fork(self) -> Iterator[None]:
        """The default CPU random stream replaced by this rank's for the block (and put back after)."""
        saved = torch.get_rng_state()
        torch.set_rng_state(self.generator.get_state())
        try:
            yield
        finally:
            self.generator.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention, heads split over the group: ``qkv`` (dim -> 3 dim, column, three
    parts) and ``proj`` (dim -> dim, row). ``heads`` must divide by the group's size. Attention dropout runs
    on split activations: each rank's own stream (``RNGTracker``)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, group: GroupLike = None, *,
                 seed: int = 0, dense: tuple[nn.Linear, nn.Linear] | None = None) -> None:
        super().__init__()
        g = _group(group)
        check_heads("ParallelSelfAttention", heads, g.size)
        if dim % heads:
            raise ValueError(f"ParallelSelfAttention: dim {dim} is not a multiple of heads {heads}")
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        qkv, proj = dense if dense is not None else (nn.Linear(dim, 3 * dim), nn.Linear(dim, dim))
        self.qkv = ColumnParallelLinear.from_dense(qkv, g, parts=3)
        self.proj = RowParallelLinear.from_dense(proj, g)
        self.rng = RNGTracker(seed, g.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        p = self.dropout if self.training else 0.0
        with self.rng.fork():
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: torch.Tensor = self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return out


class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with ``fc1`` column- and ``fc2`` row-parallel, then dropout on the replicated
    output (the default stream: the same mask on every rank)."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, group: GroupLike = None) -> None:
        super().__init__()
        g = _group(group)
        self.fc1 = ColumnParallelLinear(dim, hidden, group=g)
        self.fc2 = RowParallelLinear(hidden, dim, group=g)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.fc2(F.gelu(self.fc1(x))))
        return out


def check_embedding(what: str, emb: nn.Embedding) -> None:
    """Refuse an ``nn.Embedding`` with an option ``VocabParallelEmbedding`` does not have (``padding_idx``
    it has)."""
    dropped = [f"{k}={v!r}" for k, v, default in (("max_norm", emb.max_norm, None),
                                                  ("scale_grad_by_freq", emb.scale_grad_by_freq, False),
                                                  ("sparse", emb.sparse, False)) if v != default]
    if dropped:
        raise ValueError(f"{what}: an nn.Embedding with {', '.join(dropped)} is not split (the option would "
                         f"be lost); padding_idx is kept")


def check_heads(what: str, heads: int, size: int) -> None:
    if heads % size:
        raise ValueError(f"{what}: {heads} attention heads do not split over a TP group of {size} "
                         f"(heads must be a multiple of the TP size)")

