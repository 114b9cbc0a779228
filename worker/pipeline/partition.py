"""Cutting a model into stages and a batch into micro-batches, with errors that carry the values."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class BalanceError(ValueError):
    """``balance`` does not cut the model into stages."""


def split_model(model: nn.Module | Sequence[nn.Module], balance: Sequence[int] | None) -> list[nn.Sequential]:
    """The stages: ``model`` (an ``nn.Sequential``) cut into ``len(balance)`` consecutive runs of layers.

    Each stage keeps its layers' names, so its ``named_parameters()`` are
    those of the whole model (``"3.weight"`` stays ``"3.weight"``). A list of
    stage modules is one stage each, named as ``nn.Sequential(*stages)`` would
    name them (``balance`` must then be None or all ones).
    """
    if isinstance(model, (list, tuple)):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            raise TypeError("model: expected an nn.Sequential or a non-empty list of nn.Module stages")
        if balance is not None and list(balance) != [1] * len(model):
            raise BalanceError(f"a list of {len(model)} stage modules takes balance None or "
                               f"{[1] * len(model)}, got {list(balance)}")
        model, balance = nn.Sequential(*model), [1] * len(model)
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model: expected an nn.Sequential (or a list of stages), got {type(model).__name__}")
    if balance is None:
        raise BalanceError("balance is required for an nn.Sequential: the number of layers of each stage")
    balance = list(balance)
    if not balance or any(not isinstance(b, int) or b < 1 for b in balance):
        raise BalanceError(f"balance must be a non-empty list of positive layer counts, got {balance}")
    layers = list(model.named_children())
    if sum(balance) != len(layers):
        raise BalanceError(f"module and sum of balance have different length "
                           f"(module: {len(layers)}, sum of balance: {sum(balance)})")
    stages, start = [], 0
    for b in balance:
        stages.append(nn.Sequential(OrderedDict(layers[start:start + b])))
        start += b
    return stages


def scatter(batch: torch.Tensor, chunks: int, what: str = "batch") -> list[torch.Tensor]:
    """``batch`` cut along its first dimension into ``chunks`` micro-batches, the first ones one larger
    when ``chunks`` does not divide it (``torch.tensor_split``)."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(batch).__name__}")
    if batch.dim() == 0 or batch.shape[0] < chunks:
        n = batch.shape[0] if batch.dim() else 0
        raise ValueError(f"{what} of {n} samples cannot be cut into {chunks} micro-batches (chunks)")
    return list(torch.tensor_split(batch, chunks))


@dataclass(frozen=True)
class StageTies:
    """Weights tied across stages (an embedding in the first stage, the output head in the last): one tensor
    of the model, so one name. ``aliases[s]``: stage s's own name of such a weight -> the model's first name
    of it (``named_parameters`` of the whole model); ``shared``: each such weight's name -> how many stages
    use it. Empty when no weight is used by two stages."""

    aliases: tuple[dict[str, str], ...]
    shared: dict[str, int]

    def under_every_name(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (by the stages' names) with each tied weight under its other names too, as the whole
        model's ``state_dict`` has it (so that ``load_state_dict`` takes it)."""
        out = dict(state)
        for aliases in self.aliases:
            for own, name in aliases.items():
                if name in state:
                    out[own] = state[name]
        return out

    def users(self, name: str, stages: Sequence[nn.Module]) -> list[str]:
        """Where ``name`` is used: "stage s (its name there)" for each stage that holds it, for messages."""
        out = []
        for s, stage in enumerate(stages):
            for n, _ in stage.named_parameters():
                if self.aliases[s].get(n, n) == name:
                    out.append(f"stage {s} ({n})")
        return out


def stage_ties(stages: Sequence[nn.Module]) -> StageTies:
    """The weights ``stages`` (cut from one model, in order) share between them: see ``StageTies``."""
    first: dict[int, str] = {}
    users: dict[int, set[int]] = {}
    for s, stage in enumerate(stages):
        for n, p in stage.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), n)
            users.setdefault(id(p), set()).add(s)
    aliases = tuple({n: first[id(p)] for n, p in stage.named_parameters() if first[id(p)] != n} for stage in stages)
    shared = {first[k]: len(v) for k, v in users.items() if len(v) > 1}
    return StageTies(aliases, shared)
