"""The tensor-parallel plan a model carries (Hugging Face transformers' ``_tp_plan``), in shardps's kinds.

transformers models ship their plan as data: ``model._tp_plan`` (the whole model's, set when it is built),
else ``model.config.base_model_tp_plan`` (the base model's, under ``base_model_prefix``). Its patterns are
module names with ``*`` for a layer's index, which ``fnmatch`` reads as shardps's plans do. Each kind maps
to one of shardps's (``TRANSFORMERS_KINDS``); ``replicate`` (every rank keeps the whole parameter) maps to
nothing, as a module left out of a plan is replicated. Any other kind has no shardps equivalent and is
refused by name, before anything changes. Reads attributes only: transformers is never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

#: transformers' plan kind -> shardps's (None: replicated, left out of the plan).
TRANSFORMERS_KINDS: dict[str, str | None] = {
    "colwise": "column",
    "colwise_gather_output": "column_gather",
    "colwise_rep": "column_gather",
    "rowwise": "row",
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "partial_grad",
    "replicate": None,
}


def _model_plan(model: nn.Module) -> dict[str, str]:
    own = getattr(model, "_tp_plan", None)
    if own:
        return dict(own)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not base:
        raise ValueError(f"tp.plan_of: {type(model).__name__} carries no tensor-parallel plan (no _tp_plan, no "
                         f"config.base_model_tp_plan): pass one to tp.split, patterns over module names to "
                         f"kinds, e.g. {{'layers.*.mlp.up': 'column', 'layers.*.mlp.down': 'row'}}")
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def translate(plan: Mapping[str, str]) -> dict[str, str]:
    """A transformers plan in shardps's kinds; ``ValueError`` naming the first pattern whose kind has no
    shardps equivalent."""
    out: dict[str, str] = {}
    for pattern, kind in plan.items():
        if kind not in TRANSFORMERS_KINDS:
            supported = ", ".join(sorted(TRANSFORMERS_KINDS))
            raise ValueError(f"tp.split: {pattern!r}: transformers kind {kind!r} has no shardps equivalent; "
                             f"supported: {supported} (or pass a plan of shardps kinds)")
        mapped = TRANSFORMERS_KINDS[kind]
        if mapped is not None:
            out[pattern] = mapped
    return out


def plan_of(model: nn.Module) -> dict[str, str]:
    """The plan ``model`` carries, in shardps's kinds: what ``tp.split(model, "auto", group)`` uses. Edit a
    copy and pass it to ``split`` to change it. ``ValueError`` when the model carries none, or names a kind
    shardps does not have."""
    return translate(_model_plan(model))
