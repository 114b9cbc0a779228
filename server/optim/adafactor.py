"""Adafactor, step for step as HuggingFace ``transformers.Adafactor``, whole or split by rows.

Per step (t counts from 1):

1. rho = min(1e-2, t^-0.5) (``warmup_init``: min(1e-6 t, t^-0.5)), or ``lr``
   when not ``relative_step``; alpha = rho * max(eps2, RMS(theta)) when
   ``scale_parameter``, else rho. RMS(theta) is taken before this step.
2. beta2 = 1 - t^decay_rate; G2 = G^2 + eps1.
3. rank >= 2, factored over the last two dims (leading dims are a batch):
   R = beta2 R + (1 - beta2) mean_{-1}(G2); C = beta2 C + (1 - beta2) mean_{-2}(G2);
   U = G * rsqrt(R / mean_{-1}(R)) (x) rsqrt(C).
   rank <= 1: V = beta2 V + (1 - beta2) G2; U = G * rsqrt(V).
4. U /= max(1, RMS(U) / clip_threshold); U *= alpha.
5. ``beta1``: m = beta1 m + (1 - beta1) U; U = m.
6. ``weight_decay``: theta -= weight_decay * alpha * theta. 7. theta -= U.

Split tensors. A part is a block of rows (dim 0) of the full tensor. What
spans more than the part goes through ``reduce`` (the same calls, in the same
order, on every part of a tensor):

- ``"adafactor.stats"`` (op "sum", once per step, before the update; skipped
  when empty, i.e. rank != 2 and not ``scale_parameter``): the concatenation
  of [sum(theta^2)] if ``scale_parameter``, then, for rank 2 only, the
  column sums of G2 (m values) and sum(R) (1 value). For rank 2 the column
  mean and mean_{-1}(R) run over dim 0, the split dim, so they are
  tensor-wide; for rank >= 3 the split dim is a batch dim and the factored
  statistics stay local.
- ``"adafactor.update_sumsq"`` (op "sum", once per step): [sum(U^2)] before
  clipping.

Means divide by the full tensor's sizes. State per part: ``step`` (0-d),
``exp_avg_sq_row`` (the part's rows), ``exp_avg_sq_col`` (rank 2: all m
columns, the same on every part; rank >= 3: the part's leading indices) or
``exp_avg_sq`` (rank <= 1), and ``exp_avg`` with ``beta1``.
"""

from __future__ import annotations

import math

import torch

from shardps.protos.optim import Adafactor
from shardps.server.optim.base import (
    PartInfo,
    Reduce,
    ServerOptimizer,
    State,
    check_row_block,
    local_reduce,
)


def _sumsq(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) as a 1-element fp32 tensor."""
    out: torch.Tensor = torch.linalg.vector_norm(x).square().reshape(1)
    return out


class AdafactorImpl(ServerOptimizer):
    spec: Adafactor

    def init_state(self, param: torch.Tensor, part: PartInfo) -> State:
        check_row_block("adafactor", param, part)
        shape = part.shape
        state: State = {"step": torch.zeros((), dtype=torch.float32)}
        if len(shape) >= 2:
            state["exp_avg_sq_row"] = torch.zeros(shape[:-1], dtype=torch.float32, device=param.device)
            state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:], dtype=torch.float32,
                                                  device=param.device)
        else:
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        if self.spec.beta1 is not None:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return state

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: State, part: PartInfo,
             reduce: Reduce = local_reduce) -> None:
        s = self.spec
        check_row_block("adafactor", param, part)
        state["step"] += 1
        full_numel = math.prod(part.full_shape)
        if full_numel == 0:
            return
        t = float(state["step"].item())
        rank = len(part.full_shape)
        # rank 2: the row mean of R and the column mean of G2 run over dim 0,
        # which is split; rank >= 3: dim 0 is a batch dim and they stay local.
        across = rank == 2

        if s.relative_step:
            rho = min(1e-6 * t if s.warmup_init else 1e-2, 1.0 / math.sqrt(t))
        else:
            assert s.lr is not None
            rho = s.lr
        beta2t = 1.0 - math.pow(t, s.decay_rate)
        eps1, eps2 = s.eps

        g2 = grad.square().add_(eps1)
        if rank >= 2:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2t).add_(g2.mean(dim=-1), alpha=1.0 - beta2t)

        stats: list[torch.Tensor] = []
        if s.scale_parameter:
            stats.append(_sumsq(param))
        if across:
            stats.append(g2.sum(dim=-2))
            stats.append(row.sum().reshape(1))
        total = reduce("adafactor.stats", torch.cat(stats), "sum") if stats else None

        alpha = rho
        if s.scale_parameter:
            assert total is not None
            rms = math.sqrt(max(float(total[0].item()), 0.0) / full_numel)
            alpha = max(eps2, rms) * rho

        if rank >= 2:
            if across:
                n = part.full_shape[0]
                m = part.full_shape[1]
                off = 1 if s.scale_parameter else 0
                assert total is not None
                col_mean = total[off:off + m] / n
                row_mean = total[off + m:off + m + 1] / n
            else:
                col_mean = g2.mean(dim=-2)
                row_mean = row.mean(dim=-1, keepdim=True)
            col.mul_(beta2t).add_(col_mean, alpha=1.0 - beta2t)
            del g2
            r_factor = (row / row_mean).rsqrt_().unsqueeze(-1)
            c_factor = col.unsqueeze(-2).rsqrt()
            update = torch.mul(r_factor, c_factor).mul_(grad)
        else:
            v = state["exp_avg_sq"]
            v.mul_(beta2t).add_(g2, alpha=1.0 - beta2t)
            del g2
            update = v.rsqrt().mul_(grad)

        usq = float(reduce("adafactor.update_sumsq", _sumsq(update), "sum")[0].item())
        rms_u = math.sqrt(max(usq, 0.0) / full_numel)
        update.div_(max(rms_u / s.clip_threshold, 1.0))
        update.mul_(alpha)

        if s.beta1 is not None:
            exp_avg = state["exp_avg"]
            exp_avg.mul_(s.beta1).add_(update, alpha=1.0 - s.beta1)
            update = exp_avg

        if s.weight_decay != 0:
            param.add_(param, alpha=-s.weight_decay * alpha)
        param.sub_(update)
