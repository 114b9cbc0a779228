"""One pipeline stage at run time: forwards and backwards of micro-batches, recomputation, weight versions.

``StageRuntime`` has no Ray in it: a Ray actor (shardps.deploy.ray.pipeline)
or the in-process ``LocalPipeline`` calls ``forward`` and ``backward`` in the
order of the schedule, one call at a time.

- Transparency: gradients accumulate over the micro-batches, each loss
  weighted by its share of the batch under ``reduction="mean"``, so they
  equal the gradients of the whole batch on one process. Randomness (dropout)
  is drawn from a generator seeded per (step, micro-batch, stage), the same
  in the forward and in its recomputation (``seed_for``).
- Recomputation (``checkpoint``): ``"always"`` keeps only a micro-batch's
  input and runs its forward again in the backward; ``"except_last"`` (as
  torchgpipe) does that for all but the last micro-batch, whose backward
  comes first; ``"never"`` keeps every activation.
- Extra loss terms (worker/experts/auxloss.py: the balancing loss of every
  ``shardps.nn.MoE`` in the stage): collected during each micro-batch's
  forward (and its recomputation) and added, times the micro-batch's loss
  weight, to that micro-batch's backward on this stage; their values are
  summed in ``aux_losses`` for the step's loss.
- Weight versions: every forward runs on the weights installed last and
  remembers them; its backward (and its recomputation) runs on exactly
  those, even if newer weights were installed in between (weight stashing,
  as PipeDream). ``install()`` never changes tensors a pending micro-batch
  uses. Gradients are summed over all versions used in a step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from shardps.worker.experts import auxloss
from shardps.worker.pipeline.names import CHECKPOINT_MODES
from shardps.worker.pipeline.offload import Offloader, Sink, check_compress, use_mask_relu


def seed_for(seed: int, step: int, microbatch: int, stage: int) -> int:
    """The RNG seed of one micro-batch's forward on one stage (and of its recomputation)."""
    return (seed * 1_000_003 + step * 10_007 + microbatch * 101 + stage) % (2**63 - 1)


def check_checkpoint(mode: str) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
    return mode


@dataclass
class _Pending:
    """What a micro-batch's backward needs from its forward."""

    x: torch.Tensor
    y: torch.Tensor | None  # None: recompute in the backward
    params: dict[str, torch.Tensor]
    version: int
    seed: int
    aux: torch.Tensor | None = None  # the forward's extra loss terms, summed (None: none, or recomputed)


@dataclass
class Interval:
    """A span of work on a stage: kind F (forward), B (backward), R (recomputation inside a backward)."""

    kind: str
    microbatch: int
    start: float
    end: float


@dataclass
class StageRuntime:
    """Stage ``index`` of ``num_stages``: ``module`` (its layers, named as in the whole model)."""

    module: nn.Module
    index: int
    num_stages: int
    checkpoint: str = "except_last"
    seed: int = 0
    offload: Sink | None = None  # where saved activations go (None: they stay)
    compress: tuple[str, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    loss_fn: Callable[..., torch.Tensor] | None = None
    key_prefix: str = ""  # of its offloaded tensors' keys (a pipeline replica's, when stores are shared)
    # A weight tied to another stage's (partition.stage_ties): this stage's name of it -> the model's name, the
    # one it is known by here (its gradients, its state, the servers' tensor).
    aliases: dict[str, str] = field(default_factory=dict)
    # The weights tied across stages (the model's name -> how many stages use it): each pushes k times its
    # part, so that the servers' mean over the k x R pushes is the sum over stages, averaged over replicas.
    shared: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_checkpoint(self.checkpoint)
        self.compress = check_compress(self.compress)
        if "relu-mask" in self.compress:
            use_mask_relu(self.module)
        self.module.to(self.device)
        # Where the forward reads each parameter: (owner module, attribute, the parameter's name), a tied
        # one under each of its names. ``_run`` puts the version's tensors there for the call, as
        # torch.func.functional_call does, without its per-call checks (about 40 us a task, measured).
        canonical = {id(p): self.aliases.get(n, n) for n, p in self.module.named_parameters()}
        self.names = list(canonical.values())
        self._slots: list[tuple[nn.Module, str, str]] = []
        for full, p in self.module.named_parameters(remove_duplicate=False):
            owner, _, attr = full.rpartition(".")
            self._slots.append((self.module.get_submodule(owner), attr, canonical[id(p)]))
        self.version = 0
        self.params: dict[str, torch.Tensor] = {canonical[id(p)]: p.detach().requires_grad_(p.requires_grad)
                                                for p in self.module.parameters()}
        self.step = 0
        self.chunks = 1
        self._pending: dict[int, _Pending] = {}
        self._grads: dict[str, torch.Tensor] = {}
        self.timeline: list[Interval] = []
        self.versions: list[tuple[int, int, int, int]] = []  # (step, microbatch, forward's, backward's)
        self.aux_losses: list[float] = []  # this step's extra loss terms (weighted), one per backward with any
        self.offloader = Offloader(self.offload, self._param_storages(), self.compress,
                                   prefix=f"{self.key_prefix}s{self.index}/")
        self._dict_version: dict[int, int] = {id(self.params): 0}

    def _param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.params.values()}

    # -- weights -----------------------------------------------------------

    def install(self, params: dict[str, torch.Tensor], version: int | None = None, detach: bool = True) -> None:
        """From now on forwards run on ``params`` (new tensors; pending micro-batches keep theirs).
        ``detach=False``: on those very tensors (a streamed stage's parameters, whose hooks see the
        gradients), already on the stage's device."""
        self.params = {n: params[n].detach().to(self.device).requires_grad_(self.params[n].requires_grad)
                       if detach else params[n] for n in self.names}
        self.version = self.version + 1 if version is None else version
        self._dict_version = {k: v for k, v in self._dict_version.items()
                              if any(id(p.params) == k for p in self._pending.values())}
        self._dict_version[id(self.params)] = self.version
        self.offloader.params = self._param_storages()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu").clone() for n, p in self.params.items()}

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients summed over the last step's micro-batches (all weight versions they used): CPU
        copies, the caller's to keep."""
        return {n: g.detach().to("cpu").clone() for n, g in self._grads.items()}

    def step_gradients(self) -> dict[str, torch.Tensor]:
        """The same sums as ``gradients()``, not copied: the tensors this stage accumulates into, on its
        device, to push as they are. Valid until the next ``begin_step``; the caller must not change them."""
        return dict(self._grads)

    # -- the step ----------------------------------------------------------

    def begin_step(self, step: int, chunks: int) -> None:
        self.step, self.chunks = step, chunks
        self._grads = {}
        self.aux_losses = []
        self.timeline = []
        self.versions = [v for v in self.versions if v[0] >= step - 1]  # the last two steps
        self.offloader.stats.reset_step()

    def recomputes(self, mb: int) -> bool:
        """Whether micro-batch ``mb``'s forward runs again in its backward (``checkpoint``)."""
        return self._recompute(mb)

    def _recompute(self, mb: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and mb != self.chunks - 1)

    def _generators(self) -> list[torch.Generator]:
        """The generators this stage's module draws from: the CPU's, and its GPU's when it has one."""
        if self.device.type != "cuda":
            return [torch.default_generator]
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return [torch.default_generator, torch.cuda.default_generators[index]]

    def _run(self, x: torch.Tensor, params: dict[str, torch.Tensor], seed: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the stage's output, the sum of the extra loss terms its modules added: None when none did)."""
        # As torch.random.fork_rng + torch.manual_seed, on this stage's generators only: manual_seed also
        # seeds every other device type (on a CPU-only build it records a traceback for each lazy CUDA,
        # XPU and MTIA seed), about 0.3-0.5 ms a call here, paid on every forward and recomputation.
        gens = self._generators()
        states = [g.get_state() for g in gens]
        try:
            for g in gens:
                g.manual_seed(seed)
            with auxloss.collect() as terms, self._using(params):
                y = self.module(x)
        finally:
            for g, state in zip(gens, states):
                g.set_state(state)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"stage {self.index} returned {type(y).__name__}, not a tensor: every stage but the "
                            f"last must return one tensor for the next")
        return y, auxloss.total(terms)

    @contextlib.contextmanager
    def _using(self, params: dict[str, torch.Tensor]) -> Iterator[None]:
        """The module's forward reads ``params`` (by name) while in this block; its own parameters after."""
        own = [owner._parameters[attr] for owner, attr, _ in self._slots]
        try:
            for owner, attr, name in self._slots:
                owner._parameters[attr] = params[name]  # type: ignore[assignment]
            yield
        finally:
            for (owner, attr, _), p in zip(self._slots, own):
                owner._parameters[attr] = p

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        """The forward of micro-batch ``mb``; its output (detached, for the next stage or the loss)."""
        t0 = time.time()
        x = x.to(self.device)
        if self.index > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        seed = seed_for(self.seed, self.step, mb, self.index)
        if self._recompute(mb):
            with torch.no_grad():
                y, _ = self._run(x, self.params, seed)
            self.offloader._hold(mb, x.numel() * x.element_size())  # kept for the recomputation
            self._pending[mb] = _Pending(x, None, self.params, self.version, seed)
        else:
            with torch.enable_grad(), self.offloader.hooks(mb):
                y, aux = self._run(x, self.params, seed)
            self._pending[mb] = _Pending(x, y, self.params, self.version, seed, aux)
        self.timeline.append(Interval("F", mb, t0, time.time()))
        return y.detach()

    def prefetch(self, mb: int) -> None:
        """Start fetching micro-batch ``mb``'s offloaded activations (ahead of its backward)."""
        group = self.offloader.group(mb)
        if self.offload is not None and group is not None:
            self.offload.prefetch(group)

    def backward(self, mb: int, grad: torch.Tensor | None = None, target: torch.Tensor | None = None,
                 weight: float = 1.0, next_mb: int | None = None) -> tuple[torch.Tensor | None, float]:
        """The backward of ``mb``: from ``grad`` (the next stage's input gradient) or, on the last stage,
        from ``loss_fn(output, target) * weight``. Returns the input gradient (None on the first stage) and
        the weighted loss (0.0 but on the last stage). The extra loss terms of the micro-batch's forward
        (``auxloss``) times ``weight`` join its backward on every stage. ``next_mb``: the micro-batch whose
        backward comes next on this stage, to prefetch its offloaded activations now."""
        t0 = time.time()
        p = self._pending.pop(mb)
        if next_mb is not None:
            self.prefetch(next_mb)
        y, used, aux = p.y, p.params, p.aux  # the graph of a kept forward holds p.params' tensors
        if y is None:
            with torch.enable_grad():
                y, aux = self._run(p.x, used, p.seed)
            self.timeline.append(Interval("R", mb, t0, time.time()))
        loss_value = 0.0
        extra = None if aux is None else aux * weight
        if extra is not None:
            self.aux_losses.append(float(extra.detach()))
        if self.index == self.num_stages - 1:
            if self.loss_fn is None or target is None:
                raise ValueError("the last stage's backward needs a loss function and the targets")
            loss = self.loss_fn(y, target.to(self.device)) * weight
            loss_value = float(loss.detach())
            torch.autograd.backward(loss if extra is None else loss + extra)
        else:
            if grad is None:
                raise ValueError(f"stage {self.index}: the backward of micro-batch {mb} needs the output gradient")
            if extra is None or not extra.requires_grad:
                torch.autograd.backward(y, grad.to(self.device))
            else:
                torch.autograd.backward([y, extra], [grad.to(self.device), torch.ones_like(extra)])
        for n, t in used.items():
            if t.grad is not None:
                acc = self._grads.get(n)
                self._grads[n] = t.grad if acc is None else acc.add_(t.grad)
                t.grad = None
        self.offloader.release(mb)
        self.versions.append((self.step, mb, p.version, self._dict_version[id(used)]))
        self.timeline.append(Interval("B", mb, t0, time.time()))
        gx = p.x.grad if self.index > 0 and p.x.requires_grad else None
        return (gx.detach() if gx is not None else None), loss_value

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A forward in eval mode (dropout off), no gradients."""
        self.module.eval()
        try:
            with torch.no_grad():
                return self._run(x.to(self.device), self.params, 0)[0]
        finally:
            self.module.train()
