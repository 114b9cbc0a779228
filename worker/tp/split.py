"""Split an ordinary model for tensor parallelism in place, from a plan of glob patterns over module names,
and gather a split model back into the dense state dict.

A plan maps patterns (``fnmatch``: ``*`` matches any run of characters, dots included) to a kind:

- ``"column"``: an ``nn.Linear`` becomes a ``ColumnParallelLinear`` (its output split; a head so split feeds
  ``vocab_parallel_cross_entropy``);
- ``"column_gather"``: the same, its output gathered whole again (``gather_output=True``: a head whose logits
  the model's own loss reads, transformers' ``colwise_gather_output``);
- ``"row"``: an ``nn.Linear`` becomes a ``RowParallelLinear`` (its input split);
- ``"vocab"``: an ``nn.Embedding`` becomes a ``VocabParallelEmbedding``;
- ``"heads"``: an attention module this knows (one with ``nn.Linear`` children ``qkv`` (dim -> 3 dim, fused
  query/key/value) and ``proj``, and an int ``heads``): ``qkv`` split by heads (column, three parts), ``proj``
  by rows. Its forward must take its head count from the tensors, as ``examples/shakespeare.py``'s ``Block``
  does (``qkv(x).chunk(3, -1)``, ``view(b, t, -1, head_dim)``);
- ``"partial_grad"``: a module kept whole whose parameters' gradients are partial on each rank (a norm
  applied per head to a column-split projection's output): each is summed over the group in the backward
  (transformers' ``replicated_with_grad_allreduce``).

``plan="auto"`` takes the plan the model carries (transformers' ``_tp_plan``; ``plan_of`` returns it as
shardps kinds, worker/tp/hfplan.py).

What a split keeps, or refuses before changing anything (``ValueError`` naming the module):

- ties: parameters that are one object before are one after (``named_parameters`` names it once, under the
  dense model's first name), when every user cuts it the same way (an embedding's ``"vocab"`` and a head's
  ``"column"`` both cut dim 0); users that would cut it differently are refused, both named;
- what a module computes: a subclass of ``nn.Linear`` / ``nn.Embedding`` with a ``forward`` of its own, extra
  parameters, buffers or children, hooks, or an embedding option the parallel layer would drop, is refused;
- attention heads: a split ``nn.Linear`` whose parent module has an int ``head_dim`` (transformers' attention
  modules) must hold whole heads on every rank (its heads a multiple of the TP size).

Every pattern must match at least one module of the right type. Parameter names do not change (a split
``mlp.fc1.weight`` is still ``mlp.fc1.weight``, holding the rank's slice), so a state dict and the
servers' tensors have the same names at every TP size; ``tp_slices`` says which parameters are split.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from shardps.worker.tp.group import GroupLike, Slice, TPGroup, as_group
from shardps.worker.tp.hfplan import plan_of
from shardps.worker.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_embedding,
    check_heads,
)

KINDS = ("column", "column_gather", "row", "vocab", "heads", "partial_grad")
_COLUMN = ("column", "column_gather")


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, new)


def _split_one(name: str, module: nn.Module, kind: str, group: TPGroup) -> nn.Module | None:
    """The module that replaces ``module`` (None: ``module`` is kept, changed in place)."""
    if kind == "heads":
        module.qkv = ColumnParallelLinear.from_dense(module.qkv, group, parts=3)  # type: ignore[arg-type]
        module.proj = RowParallelLinear.from_dense(module.proj, group)  # type: ignore[arg-type]
        return None
    if kind == "partial_grad":
        module.register_forward_pre_hook(SumGrads(group))
        return None
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_dense(module, group)
    assert isinstance(module, nn.Linear)
    if kind in _COLUMN:
        return ColumnParallelLinear.from_dense(module, group, gather_output=kind == "column_gather")
    return RowParallelLinear.from_dense(module, group)


class SumGrads:
    """A forward pre-hook (``"partial_grad"``): each tensor the module's own parameters are at the call (a
    pipeline stage installs a new one each weight version) gets a hook that sums its gradient over the group
    as the backward computes it. Each backward's share is summed once, so gradients accumulated over several
    backwards (micro-batches) are summed as they come, never twice."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or self.group.size == 1:
            return
        for t in module._parameters.values():
            if t is not None and t.requires_grad and getattr(t, "_tp_grad_summed", None) is None:
                t.register_hook(self._sum)  # type: ignore[no-untyped-call]
                setattr(t, "_tp_grad_summed", self)  # noqa: B010  (hooked once, by whichever SumGrads came first)

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(grad.contiguous().clone())


def _refuse_changed(name: str, m: nn.Module, base: type[nn.Module], kind: str) -> None:
    """Refuse ``m`` when replacing it by the parallel layer would change what it computes."""
    what = f"tp.split: {name} ({type(m).__name__})"
    if type(m) is not base:
        if type(m).forward is not base.forward:
            raise ValueError(f"{what} subclasses nn.{base.__name__} with a forward of its own; {kind!r} would "
                             f"replace it by a parallel layer whose forward is nn.{base.__name__}'s, losing "
                             f"that work: split a plain nn.{base.__name__}, or leave it out of the plan")
        extra = sorted((set(m._parameters) - {"weight", "bias"}) | set(m._buffers) | set(m._modules))
        if extra:
            raise ValueError(f"{what} subclasses nn.{base.__name__} and holds {', '.join(extra)}, which the "
                             f"parallel layer would not keep")
    if "forward" in vars(m):
        raise ValueError(f"{what} has a forward set on the module itself (as accelerate's hooks do); {kind!r} "
                         f"would replace the module and drop it (refused)")
    hooks = [h for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
             if getattr(m, h, None)]
    if hooks or parametrize.is_parametrized(m):
        raise ValueError(f"{what} has {'parametrizations' if not hooks else ', '.join(hooks)}; {kind!r} would "
                         f"replace the module and drop them (refused)")
    if isinstance(m, nn.Embedding):
        check_embedding(f"tp.split: {name}", m)


def _check_target(name: str, m: nn.Module, kind: str, parent: nn.Module | None, size: int) -> None:
    """Every reason to refuse ``kind`` on module ``name``, before anything changes."""
    if kind == "partial_grad":
        if not any(True for _ in m.parameters(recurse=False)):
            raise ValueError(f"tp.split: {name} ({type(m).__name__}) has no parameters of its own for "
                             f"'partial_grad'")
        if any(isinstance(h, SumGrads) for h in m._forward_pre_hooks.values()):
            raise ValueError(f"tp.split: {name} is 'partial_grad' already (split twice?)")
        if getattr(m, "tp_params", None) is not None:
            raise ValueError(f"tp.split: {name} ({type(m).__name__}) is split already: 'partial_grad' is for "
                             f"a replicated module")
        return
    if kind == "heads":
        qkv, proj, heads = getattr(m, "qkv", None), getattr(m, "proj", None), getattr(m, "heads", None)
        if not (isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear) and isinstance(heads, int)):
            raise ValueError(f"tp.split: {name} ({type(m).__name__}) is not an attention module split knows "
                             f"(nn.Linear qkv and proj, int heads)")
        if qkv.out_features % 3:
            raise ValueError(f"tp.split: {name}.qkv: {qkv.out_features} output features are not a fused query, "
                             f"key and value (a multiple of 3)")
        check_heads(name, heads, size)
        _refuse_changed(f"{name}.qkv", qkv, nn.Linear, kind)
        _refuse_changed(f"{name}.proj", proj, nn.Linear, kind)
        return
    want = nn.Embedding if kind == "vocab" else nn.Linear
    if not isinstance(m, want):
        why = ""
        if type(m).__name__ == "Conv1D":
            why = (" (transformers' Conv1D, GPT-2's layer, stores its weight transposed, [in, out], and GPT-2's "
                   "attention cuts the fused q/k/v output at a fixed width: it is not split)")
        raise ValueError(f"tp.split: {name} is a {type(m).__name__}; {kind!r} splits nn.{want.__name__} "
                         f"modules{why}")
    _refuse_changed(name, m, want, kind)
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(m, nn.Linear) and isinstance(head_dim, int) and head_dim > 0:
        width = m.out_features if kind in _COLUMN else m.in_features
        if width % head_dim == 0:
            check_heads(f"tp.split: {name} ({width // head_dim} heads of {head_dim})", width // head_dim, size)


Cut = Slice | str | None  # how a parameter is held: a slice, "partial" (its gradient summed), None (whole)


def _cut(pname: str, chosen: Mapping[str, str], canon: Mapping[str, str]) -> tuple[str, str, Cut]:
    """How the split cuts parameter ``pname`` (a full name): (the module, its kind, the cut). ``canon``: each
    module path -> the first name of that module (one module reached under two names is chosen under one)."""
    owner, _, attr = pname.rpartition(".")
    owner = canon.get(owner, owner)
    kind = chosen.get(owner)
    if kind in _COLUMN or kind == "vocab":
        return owner, kind, Slice(0)
    if kind == "row":
        return owner, kind, Slice(1) if attr == "weight" else None
    if kind == "partial_grad":
        return owner, kind, "partial"
    parent, _, leaf = owner.rpartition(".")
    if chosen.get(parent) == "heads" and leaf in ("qkv", "proj"):
        if leaf == "qkv":
            return parent, "heads", Slice(0, 3)
        return parent, "heads", Slice(1) if attr == "weight" else None
    return owner, kind or "not split", None


def _describe(cut: Cut) -> str:
    if cut is None:
        return "not at all (whole on every rank)"
    if isinstance(cut, str):
        return "not at all, its gradient summed over the group (partial)"
    return f"along dim {cut.dim}" + (f" in {cut.parts} parts" if cut.parts > 1 else "")


def _ties(module: nn.Module, chosen: Mapping[str, str], canon: Mapping[str, str]) -> list[list[str]]:
    """The groups of parameter names that are one tensor, each checked to be cut the same way by every user
    (``ValueError`` naming both users otherwise)."""
    users: dict[int, list[str]] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(pname)
    groups = [names for names in users.values() if len(names) > 1]
    for names in groups:
        cuts = [(n, *_cut(n, chosen, canon)) for n in names]
        first = cuts[0]
        for other in cuts[1:]:
            if other[3] != first[3]:
                raise ValueError(
                    f"tp.split: {first[0]} and {other[0]} are one tensor (tied weights); {first[2]!r} on {first[1]} "
                    f"cuts it {_describe(first[3])}, {other[2]!r} on {other[1]} {_describe(other[3])}: both "
                    f"users of a tied weight need the same cut (e.g. 'vocab' and 'column', both along dim 0)")
    return groups


def split(module: nn.Module, plan: Mapping[str, str] | str, group: GroupLike = None, *,
          strict: bool = True) -> nn.Module:
    """Split ``module``'s layers named by ``plan`` over ``group`` in place (every rank calls it on the same
    dense model); returns ``module``. ``plan``: patterns to kinds, or ``"auto"`` (the model's own plan,
    ``plan_of``). ``group``: a ``TPGroup``, a ``torch.distributed`` ``ProcessGroup`` or None (one rank).
    Raises ``ValueError`` (naming the pattern or module) before changing anything when a kind is unknown or
    does not fit its module, a tie would be cut two ways, or (``strict``) a pattern matches nothing: a
    pipeline stage, which holds a part of the model, splits with ``strict=False``."""
    g = as_group(group, "tp.split: group")
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"tp.split: plan must be a mapping of patterns to kinds or 'auto', got {plan!r}")
        plan = plan_of(module)
    elif not isinstance(plan, Mapping):
        raise TypeError(f"tp.split: plan must be a mapping of patterns to kinds or 'auto', got "
                        f"{type(plan).__name__}")
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
    # Every path of each module (one module reached under two names is replaced under both), and each path's
    # first name (the one ``named_modules`` gives, which the plan's patterns match).
    paths: dict[int, list[str]] = {}
    for n, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(n)
    canon = {alias: ps[0] for ps in paths.values() for alias in ps}
    for n, kind in chosen.items():  # check every target first: a refused plan changes nothing
        parent_name = n.rpartition(".")[0]
        _check_target(n, module.get_submodule(n), kind, module.get_submodule(parent_name), g.size)
        for outer, outer_kind in chosen.items():  # a target inside what another replaces or splits
            rest = n[len(outer) + 1:] if n.startswith(outer + ".") else None
            if rest is not None and (outer_kind not in ("heads", "partial_grad")
                                     or (outer_kind == "heads" and rest.split(".")[0] in ("qkv", "proj"))):
                raise ValueError(f"tp.split: {n} ({kind!r}) is inside {outer} ({outer_kind!r}), which splits it "
                                 f"already: name one of them in the plan")
    ties = _ties(module, chosen, canon)
    for n, kind in chosen.items():
        old = module.get_submodule(n)
        new = _split_one(n, old, kind, g)
        if new is not None:
            for alias in paths[id(old)]:
                _replace(module, alias, new)
    for tied in ties:  # one Parameter again for every user: the first user's (the dense model's first name)
        keep = module.get_parameter(tied[0])
        for pname in tied[1:]:
            owner, _, attr = pname.rpartition(".")
            setattr(module.get_submodule(owner), attr, keep)
    return module


def tp_slices(module: nn.Module) -> dict[str, tuple[Slice, tuple[int, ...]]]:
    """Every split parameter of ``module`` by its full name, a tied one under its first name only (as
    ``named_parameters`` names it): (how it is split, the whole tensor's shape). Parameters not listed are
    replicated."""
    first = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, tuple[Slice, tuple[int, ...]]] = {}
    for prefix, m in module.named_modules():
        for local, spec in getattr(m, "tp_params", {}).items():
            name = f"{prefix}.{local}" if prefix else local
            p = getattr(m, local, None)
            if p is None or first.get(id(p), name) == name:
                out[name] = spec
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


def gather(module: nn.Module, group: GroupLike = None) -> dict[str, torch.Tensor]:
    """The dense state dict of a split ``module`` (every rank calls it; every rank gets the whole)."""
    g = as_group(group)
    split_ = tp_slices(module)
    ids = {id(p): n for n, p in module.named_parameters()}
    first = {n: ids[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}  # tied name -> first
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        canon = first.get(name, name)
        if canon in out:
            out[name] = out[canon]  # a tied weight: gathered once, under each of its names as the dense state
        elif canon in split_:
            sl, shape = split_[canon]
            out[name] = assemble(t, sl, shape, g)
        else:
            out[name] = t.detach().clone()
    return out


def gather_grads(module: nn.Module, group: GroupLike = None) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (split ones gathered), by name."""
    g = as_group(group)
    split_ = tp_slices(module)
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = assemble(grad, *split_[name], g) if name in split_ else grad.detach().clone()
    return out


def clip_grad_norm_(module: nn.Module, max_norm: float, group: GroupLike = None) -> torch.Tensor:
    """Scale every gradient of a split ``module`` so that the whole model's gradient norm is at most
    ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` on the dense model); returns the norm before.
    Every slice is counted (a sum over the group), a replicated parameter once."""
    g = as_group(group)
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
    if not isinstance(plan, Mapping):
        raise TypeError(f"tp_plan: expected a mapping of module-name patterns to kinds (a pipeline's stages are "
                        f"cut from the model, so 'auto' cannot read its plan: pass tp.plan_of(model), with the "
                        f"stages' names), got {type(plan).__name__}")
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
