"""Adam and AdamW, step for step as torch.optim.Adam / AdamW's single-tensor path.

1. t += 1. 2. Adam: g += wd * theta; AdamW: theta *= 1 - lr * wd.
3. m = lerp(m, g, 1 - b1). 4. v = b2 * v + (1 - b2) * g^2 (amsgrad: vmax = max(vmax, v)).
5. denom = sqrt(v) / sqrt(1 - b2^t) + eps. 6. theta -= lr / (1 - b1^t) * m / denom.

``step_many`` runs torch's fused multi-tensor CPU/CUDA kernel
(``torch._fused_adam_``/``_fused_adamw_``, what ``torch.optim.Adam(fused=True)``
calls) over all parts that share a spec: the same update, several times faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardps.protos.optim import Adam, AdamW
from shardps.server.optim.base import PartInfo, Reduce, ServerOptimizer, State, local_reduce


class AdamImpl(ServerOptimizer):
    spec: Adam

    def __init__(self, spec: Adam) -> None:
        super().__init__(spec)
        self.decoupled = isinstance(spec, AdamW)

    def init_state(self, param: torch.Tensor, part: PartInfo) -> State:
        state: State = {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.contiguous_format),
        }
        if self.spec.amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return state

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: State, part: PartInfo,
             reduce: Reduce = local_reduce) -> None:
        s = self.spec
        beta1, beta2 = s.betas
        state["step"] += 1
        t = float(state["step"].item())
        if s.weight_decay != 0:
            if self.decoupled:
                param.mul_(1 - s.lr * s.weight_decay)
            else:
                grad = grad.add(param, alpha=s.weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        step_size = s.lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if s.amsgrad:
            vmax = state["max_exp_avg_sq"]
            torch.maximum(vmax, exp_avg_sq, out=vmax)
            denom = (vmax.sqrt() / bias_correction2_sqrt).add_(s.eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(s.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    def _fused(self) -> Any:
        return getattr(torch, "_fused_adamw_" if self.decoupled else "_fused_adam_", None)

    def takes_slices(self) -> bool:
        return self._fused() is not None  # an elementwise kernel; the step count is advanced once per part

    def step_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, State, PartInfo]]) -> None:
        fused = self._fused()
        if fused is None or len(items) == 0:
            return super().step_many(items)
        s = self.spec
        params = [it[0] for it in items]
        grads = [it[1] for it in items]
        states = [it[2] for it in items]
        steps = [st["step"] for st in states]
        torch._foreach_add_(list({id(t): t for t in steps}.values()), 1)  # slices of a part share its count
        fused(
            params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
            [st["max_exp_avg_sq"] for st in states] if s.amsgrad else [], steps,
            lr=s.lr, beta1=s.betas[0], beta2=s.betas[1], weight_decay=s.weight_decay, eps=s.eps,
            amsgrad=s.amsgrad, maximize=False,
        )
