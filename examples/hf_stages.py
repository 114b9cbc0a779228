"""A Hugging Face decoder language model as pipeline stages: ``decoder_stages(model, stages)``.

A pipeline (``shardps.ray.Pipeline``, ``LocalPipeline``) cuts an ``nn.Sequential`` between its children and
passes one tensor from stage to stage. A transformers causal LM is not one: its ``forward`` builds the
positions (and, in Llama-style models, the rotary embeddings) once and hands them to every layer. This
module re-lays the model's own submodules (the same objects, nothing copied) as a sequence whose children
each take and return the hidden states:

    Embed(tokens [+ positions])  ->  Decoder(layers a..b)  ...  ->  Head(final norm, lm_head)

Each ``Decoder`` recomputes its rotary embeddings from the hidden states' length (no parameters: a buffer),
and leaves the attention mask to the layers' causal default, so it needs ``attn_implementation="sdpa"``
(the default where torch has it), no sliding window, and inputs without padding: a model otherwise is
refused (``ValueError``), never given the wrong mask. Tied weights stay tied: the embedding and the
head hold one ``Parameter``, and a pipeline names it once across its stages (worker/pipeline/partition.py's
``stage_ties``). Families: Llama-style (``model.model.layers``: Llama, Mistral, Qwen2, Qwen3, ...) and GPT-2
(``model.transformer.h``). See docs/your-model.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Embed(nn.Module):
    """Token ids -> hidden states: the token embedding, plus learnt positions (GPT-2) and dropout."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None = None,
                 drop: nn.Module | None = None) -> None:
        super().__init__()
        self.tokens, self.positions = tokens, positions
        self.drop = drop if drop is not None else nn.Identity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[-1], device=ids.device))
        out: torch.Tensor = self.drop(h)
        return out


class Decoder(nn.Module):
    """A run of the model's decoder layers, each called with the hidden states (and, given ``rotary``, the
    rotary embeddings of positions 0..T-1)."""

    def __init__(self, layers: list[nn.Module], rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kw: dict[str, Any] = {}
        if self.rotary is not None:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            kw = {"position_ids": positions, "position_embeddings": self.rotary(h, positions)}
        for layer in self.layers:
            out = layer(h, **kw)
            h = out[0] if isinstance(out, tuple) else out
        return h


class Head(nn.Module):
    """Hidden states -> logits: the final norm and the output head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(h))
        return out


def _check_masks(model: nn.Module) -> None:
    """Refuse a model whose layers need a mask the stages do not build: only sdpa attention applies the
    causal mask by itself when given none, and it knows no sliding window."""
    config: Any = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"decoder_stages: {type(model).__name__} uses attn_implementation={impl!r}; the stages "
                         f"pass no attention mask, which is causal under 'sdpa' only (build the model with "
                         f"attn_implementation='sdpa')")
    sliding = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types or (sliding is not None and getattr(config, "use_sliding_window", True)):
        raise ValueError(f"decoder_stages: {type(model).__name__} has a sliding attention window "
                         f"({sliding}); the stages build no mask for it (set sliding_window=None, or "
                         f"use_sliding_window=False)")


def decoder_stages(model: nn.Module, stages: int) -> tuple[nn.Sequential, list[int]]:
    """``model`` (a transformers causal LM) as a sequence of ``Embed``, ``stages`` ``Decoder`` runs of its
    layers (as even as they split) and ``Head``, with the ``balance`` that puts ``Embed`` in the first stage
    and ``Head`` in the last. ``ValueError`` for a model of another shape, or fewer layers than stages."""
    base: Any
    if hasattr(model, "model") and hasattr(model.model, "layers"):  # Llama-style
        base = model.model
        embed, layers, norm, rotary = Embed(base.embed_tokens), list(base.layers), base.norm, base.rotary_emb
    elif hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2
        base = model.transformer
        embed, layers, norm, rotary = Embed(base.wte, base.wpe, base.drop), list(base.h), base.ln_f, None
    else:
        raise ValueError(f"decoder_stages: {type(model).__name__} is neither Llama-style (model.layers) nor "
                         f"GPT-2-style (transformer.h)")
    _check_masks(model)
    lm_head: Any = getattr(model, "lm_head", None)
    if not isinstance(lm_head, nn.Module):
        raise ValueError(f"decoder_stages: {type(model).__name__} has no lm_head")
    if not 1 <= stages <= len(layers):
        raise ValueError(f"decoder_stages: {len(layers)} layers cannot make {stages} stages")
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    runs = [Decoder(layers[a:b], rotary) for a, b in zip(bounds, bounds[1:])]
    balance = [1] * stages
    balance[0] += 1
    balance[-1] += 1
    return nn.Sequential(embed, *runs, Head(norm, lm_head)), balance
