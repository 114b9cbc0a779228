"""A mixture-of-experts layer whose experts live on the servers: ``shardps.nn.MoE`` (docs/moe.md).

The gate is an ordinary ``nn.Linear`` on the worker (synced as every dense
parameter); the experts are the rows of one row table (docs/sparse.md), row
i the flattened parameters of expert i. A forward routes the tokens
(worker/experts/routing.py), pulls the rows of the distinct experts that keep a
token, and runs each on its tokens with ``torch.func.functional_call``; the
rows are a leaf that records its gradient, and ``DistributedOptimizer.step()``
pushes the gradients of those rows alone (worker/rows/modules.py), which the
servers' row optimizer applies. An expert with no token is neither pulled
nor pushed. That is placement "pull"; "send" runs the experts on the shards
(worker/experts/send.py), "auto" picks one of the two each step
(worker/experts/placement.py).

The experts' first values are those ``expert()`` made on this worker
(``torch.manual_seed`` the same on every worker): every worker writes them
when the model is attached, and the first write of a row wins. The layer
keeps them (``experts.pretrained``, E x P floats) so that registering again
(a rejoin) declares the same table.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from torch import nn
from torch.func import functional_call

from shardps.protos.optim import OptimizerSpec
from shardps.protos.shardps.v1 import experts_pb2
from shardps.worker.errors import ShardError
from shardps.worker.experts import auxloss
from shardps.worker.experts import send as expertsend
from shardps.worker.experts.placement import PLACES, AutoPlacement, CostModel
from shardps.worker.experts.routing import Routing, capacity, route
from shardps.worker.rows.modules import _Rows

PLACEMENTS = ("pull", "send", "auto")


class ExpertHosts(Protocol):
    """Hosts that run the experts of "send" instead of the shards (``shardps.ray.start_expert_actors``):
    ``endpoint(shard)`` answers ``RegisterExpert``, ``Forward`` and ``Backward`` for shard ``shard``'s
    experts, with the gRPC stub's calls and errors."""

    def endpoint(self, shard: int) -> Any: ...


class ExpertRows(_Rows):
    """The experts of one MoE layer as a row table: row i is expert i's parameters, flattened in the order of
    ``template.named_parameters()``."""

    write_from_every_worker = True  # every worker writes the first values (first write wins): no early zeros

    def __init__(self, template: nn.Module, num_experts: int, experts: list[nn.Module], *, name: str | None,
                 optimizer: OptimizerSpec | None, sync: str | None) -> None:
        self.shapes = {n: p.shape for n, p in template.named_parameters()}
        numel = sum(p.numel() for p in template.parameters())
        if numel == 0:
            raise ValueError("MoE: the expert module has no parameters")
        super().__init__(num_experts, numel, name=name, optimizer=optimizer, sync=sync, init=None)
        self.registered = False
        self.pretrained = torch.stack([self.flatten(e) for e in experts])

    def flatten(self, module: nn.Module) -> torch.Tensor:
        got = {n: tuple(p.shape) for n, p in module.named_parameters()}
        if got != {n: tuple(s) for n, s in self.shapes.items()}:
            raise ValueError(f"MoE: every expert() must have the same parameters; expected {dict(self.shapes)}, "
                             f"got {got}")
        return torch.cat([p.detach().reshape(-1).to(torch.float32).cpu() for p in module.parameters()])

    def unflatten(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Expert parameters (views of ``row``, so gradients flow into it)."""
        out, at = {}, 0
        for n, s in self.shapes.items():
            k = s.numel()
            out[n] = row[at:at + k].view(s)
            at += k
        return out

    # -- placement "send" (worker/experts/send.py): the shards push this worker's gradients during backward --

    program: bytes | None = None  # the experts' TorchScript, registered on every shard at the first send
    hosts: ExpertHosts | None = None  # where each shard's experts run under "send" (None: on the shard itself)
    sent_step: int | None = None  # the step a send's backward pushed, not yet closed by step()
    hold_index: int = 0  # with ``hold``: the index of the step's latest held backward (ExpertCall.hold_index)
    hold: bool = False  # each send's backward holds its gradients on the shards, push() has them pushed
    d_model: int = 0  # the layer's (the flush's calls name it)
    on_pushed: Callable[[float], None] | None = None  # called with the time each push (a step's) ended

    def claim_step(self) -> int:
        """The step a send's backward pushes: the optimizer's next, once (a second backward in one step is
        refused), or with ``hold`` (a pipeline stage's micro-batches) as many as the step has."""
        if self.sent_step is not None and not self.hold or self._pulled:
            raise RuntimeError(f"MoE {self.table!r}: placement 'send' pushes the experts' gradients in backward, "
                               f"once per optimizer step; this step already has a forward's gradients (call "
                               f"step() between forwards of the layer)")
        if self.clock is None:
            raise RuntimeError(f"MoE {self.table!r}: not attached to a DistributedOptimizer")
        step = self.clock()
        self.hold_index = self.hold_index + 1 if self.sent_step == step else 0
        self.sent_step = step
        return step

    def register_program(self, shard: int | None = None) -> None:
        """Register the experts' program on every shard (or on ``shard`` alone: one that lost it, a server
        restarted or a backup that took over)."""
        assert self.rows is not None and self.program is not None and self.table is not None
        t, req = self.rows.transport, experts_pb2.RegisterExpertRequest(table=self.table, program=self.program)
        if shard is not None:
            self.endpoint(shard).RegisterExpert(req, timeout=t.timeout)
            return
        t.each(lambda i: self.endpoint(i).RegisterExpert(req, timeout=t.timeout))
        self.registered = True

    def endpoint(self, shard: int) -> Any:
        """What runs shard ``shard``'s experts under "send": the shard's ``Experts`` service, or the expert
        host ``hosts`` names for it (a Ray actor beside the shard: deploy/ray/experts.py). Either answers
        ``RegisterExpert``, ``Forward`` and ``Backward`` as the gRPC stub does."""
        assert self.rows is not None
        return self.rows.transport.experts(shard) if self.hosts is None else self.hosts.endpoint(shard)

    def push(self, step: int, now: bool = True, sync: str = "") -> None:
        """Push this step's gradients, unless a send's backward pushed them on the shards already (with
        ``hold``: the shards push what the step's backwards held, now; under every:X too, ``now`` or not:
        they are on the shards)."""
        if self.sent_step is not None:
            sent, self.sent_step = self.sent_step, None
            if sent != step:
                raise RuntimeError(f"MoE {self.table!r}: a send's backward pushed step {sent}, the optimizer is at "
                                   f"step {step}")
            if self.hold:
                expertsend.flush(self, step)
        else:
            super().push(step, now, sync)
        self.job_sync = sync  # the mode the next step's "send" backward pushes under
        if self.on_pushed is not None:
            self.on_pushed(time.perf_counter())

    def fetch(self, experts: torch.Tensor) -> torch.Tensor:
        """The rows of the distinct ``experts`` (ascending int64), a leaf recording its gradient when grad is on."""
        _, rows = self._lookup(experts)
        return rows


@dataclass
class MoEStats:
    """What one layer counted since it was built (exported by ``MoECollector``)."""

    tokens: int = 0  # tokens routed
    assignments: int = 0  # tokens x top_k
    dropped: int = 0  # assignments over capacity
    experts_pulled: int = 0  # rows pulled (distinct routed experts per forward)
    bytes_sent: int = 0  # payload bytes both ways: rows and gradients (pull), tokens and their gradients (send)
    placements: dict[str, int] = field(default_factory=lambda: {"pull": 0, "send": 0})  # forwards by placement


class MoE(nn.Module):
    """Mixture of experts on the servers; ``forward(x)`` with ``x`` ``[..., d_model]`` returns ``(out,
    aux_loss, expert_counts)``: ``out`` shaped as ``x`` (zero for a token whose every assignment was dropped),
    ``aux_loss`` = ``aux_loss_coef * E * sum f_i P_i``, ``expert_counts`` the assignments per expert before
    drops ([E] int64). ``expert``: a function returning one expert's ``nn.Module`` (called ``num_experts``
    times: the experts' first values). ``optimizer``/``sync``: the experts' row table's (docs/sparse.md)."""

    def __init__(self, d_model: int, num_experts: int, expert: object, *, name: str | None = None, top_k: int = 1,
                 capacity_factor: float = 1.25, eval_capacity_factor: float | None = None, min_capacity: int = 4,
                 drop_tokens: bool = True, aux_loss_coef: float = 1e-2, placement: str = "pull",
                 optimizer: OptimizerSpec | None = None, sync: str | None = None,
                 cost_model: CostModel | None = None, expert_hosts: ExpertHosts | None = None) -> None:
        super().__init__()
        if not callable(expert):
            raise TypeError(f"MoE: expert must be a function returning an nn.Module, got {type(expert).__name__}")
        if placement not in PLACEMENTS:
            raise ValueError(f"MoE: placement is one of {PLACEMENTS}, got {placement!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be in [1, {num_experts}] (num_experts), got {top_k}")
        if capacity_factor <= 0 or (eval_capacity_factor is not None and eval_capacity_factor <= 0):
            raise ValueError(f"MoE: capacity factors must be > 0, got {capacity_factor}, {eval_capacity_factor}")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = capacity_factor if eval_capacity_factor is None else eval_capacity_factor
        self.min_capacity, self.drop_tokens, self.aux_loss_coef = min_capacity, drop_tokens, aux_loss_coef
        self.placement = placement
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        made = [expert() for _ in range(num_experts)]
        if not all(isinstance(m, nn.Module) for m in made):
            raise TypeError("MoE: expert() must return an nn.Module")
        self.template = [made[0]]  # a list: not a submodule (its parameters are not the model's)
        self.experts = ExpertRows(made[0], num_experts, made, name=name, optimizer=optimizer, sync=sync)
        if placement != "pull":
            self.experts.program = expertsend.program_bytes(made[0])
        elif expert_hosts is not None:
            raise ValueError("MoE: expert_hosts run the experts of placement 'send' (or 'auto'), not 'pull'")
        self.experts.hosts, self.experts.d_model = expert_hosts, d_model
        self.auto = AutoPlacement()  # placement "auto": the measured step times (worker/experts/placement.py)
        self.cost_model = cost_model or CostModel()  # "auto"'s prediction before it has times
        if placement == "auto":
            self.experts.on_pushed = self.auto.close  # a step: from the layer's forward to its push
        self.stats = MoEStats()
        self.last: Routing | None = None  # the last forward's routing

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes for a batch of ``tokens`` (None: dropless)."""
        if not self.drop_tokens:
            return None
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return capacity(tokens, self.num_experts, self.top_k, factor, self.min_capacity)

    def expert_module(self, i: int) -> nn.Module:
        """A copy of expert ``i`` with its current weights (pulled from the servers)."""
        if not 0 <= i < self.num_experts:
            raise IndexError(f"MoE: expert {i} out of range [0, {self.num_experts})")
        with torch.no_grad():
            row = self.experts.fetch(torch.tensor([i]))[0]
        module: nn.Module = copy.deepcopy(self.template[0])
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(self.experts.unflatten(row)[n])
        return module

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE {self.experts.table or ''}: x must be [..., {self.d_model}] (d_model), got "
                             f"{list(x.shape)}")
        if self.experts.rows is None:
            raise RuntimeError(f"MoE {self.experts.table or ''}: its experts live on the servers; give the model to "
                               f"shardps.DistributedOptimizer before the first forward")
        if self.placement != "pull" and not self.experts.registered:
            self.experts.register_program()  # before any step is timed
        h = x.reshape(-1, self.d_model)
        probs = F.softmax(self.gate(h).float(), dim=-1)
        r = route(probs, self.top_k, self.capacity(h.shape[0]))
        self.last = r
        s = self.stats
        s.tokens += h.shape[0]
        s.assignments += r.expert.numel()
        s.dropped += r.dropped
        if self.choose(r) == "send":
            try:
                out = self._send(h, r)
            except ShardError as e:
                if self.experts.pull_failed is not None:  # the optimizer's: a rollback met here raises RolledBack
                    self.experts.pull_failed(e)
                raise
        else:
            out = self._pull(h, r)  # a rollback met by its PullRows: as any row table's (_Rows._lookup)
        aux = self.aux_loss_coef * r.aux
        auxloss.add(aux)  # inside a pipeline stage: joins this micro-batch's loss (worker/experts/auxloss.py)
        return out.view(x.shape), aux, r.counts

    def cost(self, r: Routing) -> dict[str, float]:
        """The seconds the cost model (``self.cost_model``, worker/experts/placement.py) predicts for a training
        step of each placement on routing ``r``: two round trips, then per distinct expert kept (its row and
        gradient, or its calls on the shards) and per kept assignment (its compute here or there, its
        tokens on the link)."""
        return self.cost_model.seconds(experts=len(r.active()), assignments=int(r.keep.sum()),
                                       params=self.experts.embedding_dim, d_model=self.d_model)

    def choose(self, r: Routing) -> str:
        """The placement of this forward: the layer's, or for "auto" ``AutoPlacement``'s (worker/experts/placement.py):
        measured step times per batch size once it has them (from this forward to the optimizer's push of
        the layer's experts), the cost model's before; a forward without grad (evaluation) takes the
        cheaper by the cost model and is not timed. With ``experts.hold`` (a pipeline stage: several
        forwards a step) every forward of a step takes the placement of its first training forward, and the
        step is timed from that forward to the push."""
        if self.placement != "auto":
            return self.placement
        if self.experts.hold and self.auto.open is not None:
            return self.auto.open[1]  # the step's placement: its micro-batches push the same way
        cost, now, tokens = self.cost(r), time.perf_counter(), r.expert.shape[0]
        self.auto.close(now, valid=False)  # a step still open (no push since its forward): not counted
        if not (self.training and torch.is_grad_enabled()):
            return min(PLACES, key=lambda p: (cost[p], p != "pull"))
        chosen = self.auto.choose(tokens, cost)
        self.auto.start(tokens, chosen, now)
        return chosen

    def _send(self, h: torch.Tensor, r: Routing) -> torch.Tensor:
        """Send the tokens to the shards that hold their experts (worker/experts/send.py)."""
        e = self.experts
        if e.rows is None:
            raise RuntimeError("MoE: not attached")
        self.stats.placements["send"] += 1
        p = expertsend.plan(r, e.rows.transport.num_shards)
        out = torch.zeros_like(h, dtype=torch.float32)
        if not len(p.tok):
            return out.to(h.dtype)
        anchor = torch.zeros(0, requires_grad=torch.is_grad_enabled())
        y = expertsend.Send.apply(h[p.tok].float(), anchor, e, p, self.stats)  # type: ignore[no-untyped-call]
        return out.index_add(0, p.tok, y * r.weight[p.tok, p.rank].unsqueeze(-1)).to(h.dtype)

    def _pull(self, h: torch.Tensor, r: Routing) -> torch.Tensor:
        """Pull the routed experts' rows and run them here."""
        active = r.active()
        self.stats.placements["pull"] += 1
        self.stats.experts_pulled += len(active)
        self.stats.bytes_sent += 2 * len(active) * (self.experts.embedding_dim * 4 + 16)
        out = torch.zeros_like(h, dtype=torch.float32)
        if not len(active):
            return out.to(h.dtype)
        rows = self.experts.fetch(active)
        for j, e in enumerate(active.tolist()):
            tok, rank = r.tokens_of(e)
            y = functional_call(self.template[0], self.experts.unflatten(rows[j]), (h[tok],))
            out = out.index_add(0, tok, y.float() * r.weight[tok, rank].unsqueeze(-1))
        return out.to(h.dtype)


class MoECollector(Collector):
    """The MoE layers of ``model`` as Prometheus counters, read at scrape time (label ``layer``: the module's
    path): ``shardps_moe_tokens_total``, ``shardps_moe_dropped_total`` (assignments over capacity),
    ``shardps_moe_experts_pulled_total`` and ``shardps_moe_forwards_total{placement}`` (the placement each
    forward took: "auto"'s choice). ``registry.register(MoECollector(model))``."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {path or "moe": m for path, m in model.named_modules() if isinstance(m, MoE)}

    def collect(self) -> Iterator[CounterMetricFamily]:
        tokens = CounterMetricFamily("shardps_moe_tokens", "Tokens routed by the layer.", labels=["layer"])
        dropped = CounterMetricFamily("shardps_moe_dropped", "Token-to-expert assignments dropped over capacity.",
                                      labels=["layer"])
        pulled = CounterMetricFamily("shardps_moe_experts_pulled", "Expert rows pulled (distinct routed experts).",
                                     labels=["layer"])
        forwards = CounterMetricFamily("shardps_moe_forwards", "Forwards of the layer by the placement taken.",
                                       labels=["layer", "placement"])
        for path, m in self.layers.items():
            tokens.add_metric([path], m.stats.tokens)
            dropped.add_metric([path], m.stats.dropped)
            pulled.add_metric([path], m.stats.experts_pulled)
            for placement, n in m.stats.placements.items():
                forwards.add_metric([path, placement], n)
        yield from (tokens, dropped, pulled, forwards)
