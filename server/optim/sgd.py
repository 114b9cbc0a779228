"""SGD, step for step as torch.optim.SGD's single-tensor path.

g += wd * theta; with momentum: buf = g on the first step, else
buf = momentum * buf + (1 - dampening) * g; g = g + momentum * buf (Nesterov)
or g = buf; theta -= lr * g.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardps.protos.optim import SGD
from shardps.server.optim.base import PartInfo, Reduce, ServerOptimizer, State, local_reduce


class SGDImpl(ServerOptimizer):
    spec: SGD

    def init_state(self, param: torch.Tensor, part: PartInfo) -> State:
        state: State = {"step": torch.zeros((), dtype=torch.float32)}
        if self.spec.momentum != 0:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return state

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: State, part: PartInfo,
             reduce: Reduce = local_reduce) -> None:
        first = bool(state["step"].item() == 0)
        state["step"] += 1
        self._update(param, grad, state, first)

    def takes_slices(self) -> bool:
        return True  # elementwise, and the gradient is only read: a pushed one is stepped from its chunks

    def step_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, State, PartInfo]]) -> None:
        """Each item as ``step``; slices of one part (``split_state``) share its step count, read once
        before and advanced once after."""
        counts = {id(st["step"]): st["step"] for _, _, st, _ in items}
        first = {k: bool(t.item() == 0) for k, t in counts.items()}
        for param, grad, state, _ in items:
            self._update(param, grad, state, first[id(state["step"])])
        for t in counts.values():
            t += 1

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: State, first: bool) -> None:
        s = self.spec
        if s.weight_decay != 0:
            grad = grad.add(param, alpha=s.weight_decay)
        if s.momentum != 0:
            buf = state["momentum_buffer"]
            if first:
                buf.copy_(grad)
            else:
                buf.mul_(s.momentum).add_(grad, alpha=1 - s.dampening)
            grad = grad.add(buf, alpha=s.momentum) if s.nesterov else buf
        param.add_(grad, alpha=-s.lr)
