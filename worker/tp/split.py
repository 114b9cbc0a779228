"""Split an ordinary model for tensor parallelism in place, from a plan of glob patterns over module names,
and gather a split model back into the dense state dict.

A plan maps patterns (``fnmatch``: ``*`` matches any run of characters, dots included) to a kind:

- ``"column"``: an ``nn.Linear`` becomes a ``ColumnParallelLinear`` (its output split; a head so split feeds
  ``vocab_parallel_cross_entropy``);
- ``"row"``: an ``nn.Linear`` becomes a ``RowParallelLinear`` (its input split);
- ``"vocab"``: an ``nn.Embedding`` becomes a ``VocabParallelEmbedding``;
- ``"heads"``: an attention module this knows (one with ``nn.Linear`` children ``qkv`` (dim -> 3 dim, fused
  query/key/value) and ``proj``, and an int ``heads``): ``qkv`` split by heads (column, three parts), ``proj``
  by rows. Its forward must take its head count from the tensors, as ``examples/shakespeare.py``'s ``Block``
  does (``qkv(x).chunk(3, -1)``, ``view(b, t, -1, head_dim)``).

Every pattern must match at least one module of the right type. Parameter names do not change (a split
``mlp.fc1.weight`` is still ``mlp.fc1.weight``, holding the rank's slice), so a state dict and the
servers' tensors have the same names at every TP size; ``tp_slices`` says which parameters are split.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn

from shardps.worker.tp.group import Slice, TPGroup
from shardps.worker.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, check_heads

KINDS = ("column", "row", "vocab", "heads")


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, new)


def _split_one(name: str, module: nn.Module, kind: str, group: TPGroup) -> nn.Module | None:
    if kind == "heads":
        qkv, proj, heads = getattr(module, "qkv", None), getattr(module, "proj", None), getattr(module, "heads", None)
        if not (isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear) and isinstance(heads, int)):
            raise ValueError(f"tp.split: {name} ({type(module).__name__}) is not an attention module split knows "
                             f"(nn.Linear qkv and proj, int heads)")
        check_heads(name, heads, group.size)
        module.qkv = ColumnParallelLinear.from_dense(qkv, group, parts=3)
        module.proj = RowParallelLinear.from_dense(proj, group)
        return None
    want = nn.Embedding if kind == "vocab" else nn.Linear
    if not isinstance(module, want):
        raise ValueError(f"tp.split: {name} is a {type(module).__name__}; {kind!r} splits nn.{want.__name__} modules")
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_dense(module, group)
    assert isinstance(module, nn.Linear)
    if kind == "column":
        return ColumnParallelLinear.from_dense(module, group)
    return RowParallelLinear.from_dense(module, group)


def split(module: nn.Module, plan: Mapping[str, str], group: TPGroup | None = None, *,
          strict: bool = True) -> nn.Module:
    """Split ``module``'s layers named by ``plan`` over ``group`` in place (every rank calls it on the same
    dense model); returns ``module``. Raises ``ValueError`` (naming the pattern or module) before changing
    anything when a kind is unknown or (``strict``) a pattern matches nothing: a pipeline stage, which holds
    a part of the model, splits with ``strict=False``."""
    g = group if group is not None else TPGroup.single()
    for pattern, kind in plan.items():
        if kind not in KINDS:
            raise ValueError(f"tp.split: {pattern!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    names = [n for n, _ in module.named_modules() if n]
    chosen: dict[str, str] = {}
    for pattern, kind in plan.items():
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits and strict:
            raise ValueError(f"tp.split: pattern {pattern!r} matches no module of {type(module).__name__}")
        for n in hits:
            if n in chosen and chosen[n] != kind:
                raise ValueError(f"tp.split: {n} is matched as {chosen[n]!r} and as {kind!r}")
            chosen[n] = kind
    for n, kind in chosen.items():  # check every target first: a refused plan changes nothing
        m = module.get_submodule(n)
        if kind == "heads":
            heads = getattr(m, "heads", None)
            if isinstance(heads, int):
                check_heads(n, heads, g.size)
        elif not isinstance(m, nn.Embedding if kind == "vocab" else nn.Linear):
            _split_one(n, m, kind, g)  # raises
    for n, kind in chosen.items():
        new = _split_one(n, module.get_submodule(n), kind, g)
        if new is not None:
            _replace(module, n, new)
    return module


def tp_slices(module: nn.Module) -> dict[str, tuple[Slice, tuple[int, ...]]]:
    """Every split parameter of ``module`` by its full name: (how it is split, the whole tensor's shape).
    Parameters not listed are replicated."""
    out: dict[str, tuple[Slice, tuple[int, ...]]] = {}
    for prefix, m in module.named_modules():
        for local, spec in getattr(m, "tp_params", {}).items():
            out[f"{prefix}.{local}" if prefix else local] = spec
    return out


def join_slices(pieces: list[torch.Tensor], sl: Slice, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor from every rank's slice (``pieces[rank]``), held in one place (a driver's)."""
    full = pieces[0].new_empty(shape)
    for r, piece in enumerate(pieces):
        sl.put(full, piece, len(pieces), r)
    return full


def assemble(local: torch.Tensor, sl: Slice, shape: tuple[int, ...], group: TPGroup) -> torch.Tensor:
    """The whole tensor from every rank's slice ``local`` of it (an all-gather over ``group``)."""
    sizes = [sl.local_shape(shape, group.size, r)[sl.dim] for r in range(group.size)]
    full = local.new_empty(shape)
    for r, piece in enumerate(group.all_gather_padded(local.detach(), sl.dim, sizes)):
        sl.put(full, piece, group.size, r)
    return full


def gather(module: nn.Module, group: TPGroup | None = None) -> dict[str, torch.Tensor]:
    """The dense state dict of a split ``module`` (every rank calls it; every rank gets the whole)."""
    g = group if group is not None else TPGroup.single()
    split_ = tp_slices(module)
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        if name in split_:
            sl, shape = split_[name]
            out[name] = assemble(t, sl, shape, g)
        else:
            out[name] = t.detach().clone()
    return out


def gather_grads(module: nn.Module, group: TPGroup | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (split ones gathered), by name."""
    g = group if group is not None else TPGroup.single()
    split_ = tp_slices(module)
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = assemble(grad, *split_[name], g) if name in split_ else grad.detach().clone()
    return out


def clip_grad_norm_(module: nn.Module, max_norm: float, group: TPGroup | None = None) -> torch.Tensor:
    """Scale every gradient of a split ``module`` so that the whole model's gradient norm is at most
    ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` on the dense model); returns the norm before.
    Every slice is counted (a sum over the group), a replicated parameter once."""
    g = group if group is not None else TPGroup.single()
    split_ = tp_slices(module)
    params = [(n, p) for n, p in module.named_parameters() if p.grad is not None]
    sq_split = sum((p.grad.double().pow(2).sum() for n, p in params if n in split_),  # type: ignore[union-attr]
                   torch.zeros((), dtype=torch.float64))
    sq_rep = sum((p.grad.double().pow(2).sum() for n, p in params if n not in split_),  # type: ignore[union-attr]
                 torch.zeros((), dtype=torch.float64))
    total = (g.all_reduce(sq_split.reshape(1)).squeeze(0) + sq_rep).sqrt().float()
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1:
        for _, p in params:
            p.grad.mul_(scale)  # type: ignore[union-attr]
    return total



def check_tp(size: int, plan: Mapping[str, str] | None, stages: list[nn.Sequential], offload: str | None,
             sync: str) -> int:
    """A pipeline's ``tensor_parallel`` checked against its other options before any actor starts; the TP
    size. Every pattern of ``plan`` must match a module of some stage."""
    from shardps.protos.syncspec import SyncSpec

    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1, got {size!r}")
    if size == 1:
        return 1
    if not plan:
        raise ValueError(f"tensor_parallel={size} needs tp_plan: which modules to split, and how "
                         f"(shardps.tp.split's plan)")
    if offload:
        raise ValueError(f"tensor_parallel={size} with offload={offload!r} is not supported yet")
    if not SyncSpec.parse(sync).barrier:
        raise ValueError(f"tensor_parallel={size} needs a barrier sync mode (bsp or every:X), not {sync}: "
                         f"a stage's push overlapping its next forwards would interleave its TP collectives")
    names = [n for st in stages for n, _ in st.named_modules() if n]
    for pattern, kind in plan.items():
        if kind not in KINDS:
            raise ValueError(f"tp_plan: {pattern!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not any(fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"tp_plan: pattern {pattern!r} matches no module of the model")
    return size
