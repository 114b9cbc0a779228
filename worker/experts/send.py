"""Placement "send" of ``shardps.nn.MoE``: the tokens go to the shards that hold their experts (docs/moe.md).

A forward sends each shard the tokens of the routed experts it holds
(``Experts.Forward``, experts.proto; server/experts/service.py) and gets their
outputs; the backward sends every shard, in parallel, those tokens again
with the gradient of the outputs (``Experts.Backward``) and gets the
tokens' gradient, while the shard pushes the experts' parameter gradients
into their row table as the worker's push of this step would (a shard with
none of this batch's experts gets an empty one: every shard counts the
step, and bsp waits for every worker on every shard). The step is the one
the optimizer's next ``step()`` pushes (``ExpertRows.clock``), so a layer
sends at most one forward's backward per optimizer step; with
``ExpertRows.hold`` (a pipeline stage's micro-batches) each backward's
gradients wait on the shards and ``flush`` has them pushed at the step.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from torch import nn

from shardps.protos import codec
from shardps.protos.rows import shard_of
from shardps.protos.shardps.v1 import experts_pb2
from shardps.worker.experts.routing import Routing
from shardps.worker.rows.client import RowClient


def program_bytes(module: nn.Module) -> bytes:
    """TorchScript of one expert (what the shards run); a clear error for a module TorchScript cannot compile."""
    try:
        with warnings.catch_warnings():  # deprecated in favour of torch.export, which takes no module as is
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(copy_of(module))
            buf = io.BytesIO()
            torch.jit.save(scripted, buf)
    except Exception as e:  # TorchScript's own errors are of many types
        raise TypeError(f"MoE placement 'send'/'auto' runs the expert on the servers as TorchScript, and "
                        f"torch.jit.script cannot compile {type(module).__name__}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return buf.getvalue()


def copy_of(module: nn.Module) -> nn.Module:
    import copy

    out: nn.Module = copy.deepcopy(module).cpu().float()
    return out


@dataclass(frozen=True)
class Plan:
    """The kept assignments in the order they travel: shard by shard, expert by expert (ascending), token
    order within an expert. ``tok``/``rank``: each travelling row's token and choice rank."""

    tok: torch.Tensor
    rank: torch.Tensor
    shards: dict[int, tuple[np.ndarray, np.ndarray, slice]]  # shard: (uint64 experts, int64 counts, rows)


def plan(r: Routing, num_shards: int) -> Plan:
    active = r.active()
    owner = shard_of(active.numpy().astype(np.uint64), num_shards)
    toks, ranks, shards, at = [], [], {}, 0
    for s in range(num_shards):
        mine = active[torch.from_numpy(np.flatnonzero(owner == s))]
        counts = []
        for e in mine.tolist():
            tok, rank = r.tokens_of(e)
            toks.append(tok)
            ranks.append(rank)
            counts.append(len(tok))
        n = sum(counts)
        shards[s] = (mine.numpy().astype(np.uint64), np.array(counts, dtype=np.int64), slice(at, at + n))
        at += n
    empty = torch.zeros(0, dtype=torch.int64)
    return Plan(torch.cat(toks) if toks else empty, torch.cat(ranks) if ranks else empty, shards)


def _fits(table: str, req: experts_pb2.ExpertCall) -> experts_pb2.ExpertCall:
    """``req``, or a clear error where it would pass the servers' message limit (one message a shard)."""
    size = len(req.tokens) + len(req.grad_out)
    if size > codec.MAX_CHUNK_BYTES:
        raise ValueError(f"MoE {table!r}: placement 'send' carries a shard's tokens in one message of at most "
                         f"{codec.MAX_CHUNK_BYTES} bytes; this batch needs {size} (fewer tokens a step, more "
                         f"shards, or placement 'pull')")
    return req


NO_PROGRAM = "no expert program registered"  # server/experts/service.py's refusal: a shard that lost (or never had) it


def _with_program(experts: Any, shard: int, call: Callable[[], experts_pb2.ExpertAnswer]) -> experts_pb2.ExpertAnswer:
    """``call()``; where ``shard`` answers that it holds no program (a server restarted from a checkpoint, a
    backup that took over), register it there and call again, once."""
    try:
        return call()
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or NO_PROGRAM not in (e.details() or ""):
            raise
    experts.register_program(shard)
    return call()


def _worker(experts: Any) -> int:
    """The worker id of the experts' pushes (a pipeline stage's: its replica)."""
    worker: int = experts.rows.worker_id if experts.worker is None else experts.worker
    return worker


def flush(experts: Any, step: int) -> None:
    """Have every shard push what this step's backwards held (``ExpertRows.hold``): a ``Backward`` without
    hold and without tokens, so a shard pushes the held sum, or an empty push (every shard counts the step)."""
    rows: RowClient = experts.rows
    t, sync = rows.transport, _sync(experts)
    waits = rows.waits(experts.table)

    def call(shard: int) -> int:
        req = experts_pb2.ExpertCall(table=experts.table, dim=experts.embedding_dim, d_model=experts.d_model,
                                     worker_id=_worker(experts), step=step, num_workers=experts.num_workers,
                                     sync=sync, min_round=waits[shard][0])
        return int(_with_program(experts, shard, lambda: experts.endpoint(shard).Backward(
            req, timeout=t.timeout)).ready)

    rows.took(experts.table, t.each(call), waits, step, sync)


def _sync(experts: Any) -> str:
    """The mode the experts' pushes name: the layer's own, else the job's (docs/sync.md)."""
    mode: str = experts.sync or experts.job_sync
    return mode


def _floats(data: bytes, d: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, d) if data else torch.zeros(0, d)


class Send(torch.autograd.Function):
    """``y = experts(x)`` for the travelling rows ``x`` ([n, d_model]) of ``plan``, computed on the shards.
    ``anchor``: an empty tensor that requires grad, so the backward (the experts' update) runs also when
    nothing before the layer needs a gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, experts: Any, p: Plan, stats: Any) -> torch.Tensor:
        rows: RowClient = experts.rows
        t, d = rows.transport, x.shape[1]
        xc = x.detach().float().cpu().contiguous()
        busy = [s for s, (e, _, _) in p.shards.items() if len(e)]
        waits = rows.waits(experts.table)  # what this step must see first (a shard not called: its Backward waits)

        def call(shard: int) -> bytes:
            ex, counts, sl = p.shards[shard]
            req = experts_pb2.ExpertCall(table=experts.table, dim=experts.embedding_dim, d_model=d,
                                         experts=ex.tobytes(), counts=counts.tobytes(),
                                         tokens=xc[sl].numpy().tobytes(), min_round=waits[shard][0],
                                         min_clock=waits[shard][1],
                                         # a call that waits says its epoch: a rollback meanwhile ends it ABORTED
                                         epoch=rows.epoch() if rows.epoch is not None and any(waits[shard])
                                         else None)
            ans = _with_program(experts, shard, lambda: experts.endpoint(shard).Forward(_fits(experts.table, req),
                                                                                        timeout=t.timeout))
            stats.bytes_sent += 2 * len(req.tokens)
            return bytes(ans.out)

        outs = dict(zip(busy, t.each(call, busy)))
        rows.waited_for(experts.table, waits, busy)
        y = torch.cat([_floats(outs[s], d) for s in busy]) if busy else torch.zeros(0, d)
        if y.shape != xc.shape:
            raise ValueError(f"MoE {experts.table!r}: placement 'send' needs experts whose output is [n, d_model] "
                             f"({list(xc.shape)}), the servers answered {list(y.shape)}")
        ctx.save_for_backward(xc)
        ctx.experts, ctx.plan, ctx.stats = experts, p, stats
        return y.to(x.dtype).to(x.device)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        (xc,) = ctx.saved_tensors
        experts, p, stats = ctx.experts, ctx.plan, ctx.stats
        rows: RowClient = experts.rows
        t, d = rows.transport, xc.shape[1]
        step = experts.claim_step()
        index = experts.hold_index  # the same in every shard's call and in its retries
        dyc = dy.detach().float().cpu().contiguous()
        sync = _sync(experts)
        waits = rows.waits(experts.table)

        def call(shard: int) -> tuple[bytes, int]:
            ex, counts, sl = p.shards.get(shard, (np.zeros(0, np.uint64), np.zeros(0, np.int64), slice(0, 0)))
            req = experts_pb2.ExpertCall(table=experts.table, dim=experts.embedding_dim, d_model=d,
                                         experts=ex.tobytes(), counts=counts.tobytes(),
                                         tokens=xc[sl].numpy().tobytes(), grad_out=dyc[sl].numpy().tobytes(),
                                         worker_id=_worker(experts), step=step, num_workers=experts.num_workers,
                                         hold=experts.hold, hold_index=index, sync=sync, min_round=waits[shard][0],
                                         epoch=rows.epoch() if rows.epoch is not None else None)
            ans = _with_program(experts, shard, lambda: experts.endpoint(shard).Backward(
                _fits(experts.table, req), timeout=t.timeout))
            stats.bytes_sent += len(req.tokens) * 3
            return bytes(ans.out), int(ans.ready)

        answers = t.each(call)
        if not experts.hold:  # pushed on every shard: what its next calls wait for
            rows.took(experts.table, [r for _, r in answers], waits, step, sync)
        dx = torch.cat([_floats(o, d) for o, _ in answers])
        return dx.to(dy.dtype).to(dy.device), None, None, None, None
