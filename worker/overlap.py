"""Overlap for ``DistributedOptimizer(overlap=True)``: push during backward, pull during the next forward.

Push: a post-accumulate-grad hook on every parameter hands each finished
gradient to its bucket (about ``bucket_bytes``, parameters in reverse
order, as DDP: backward finishes the last layers first); a full bucket goes
into the step's ``BucketedPush`` at once, so its bytes travel while backward
computes the layers before it. The stream opens at the step's first
gradient; ``step()`` hands in what is left (partial buckets, parameters
without a hook call) and closes it.

Pull: ``step()`` starts the pull of the new weights and returns. A forward
pre-hook on every module that holds parameters waits for that module's own
parameters only (``PullInFlight.wait``); each shard sends its tensors in
the model's order, so the first layers are in first. The wait is for the
version the sync mode asks (the pull's ``min_version``), so no module runs
on older weights than without overlap.

When overlap cannot be kept exact it steps aside for that step, and
``step()`` pushes the whole gradient as without overlap: a parameter whose
gradient hook fires twice in one step (backward run twice), or a pull
that failed (its error is raised by ``step()``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from shardps.protos.syncspec import SyncSpec
from shardps.worker.accumulate import Accumulator
from shardps.worker.datapath.bucketedpush import BucketedPush
from shardps.worker.datapath.pull import PullInFlight

DEFAULT_BUCKET_BYTES = 25 << 20  # as DDP's bucket_cap_mb


def buckets(params: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Parameter names in reverse order, cut into buckets of at most ``bucket_bytes`` (fp32; a larger
    parameter is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for n in reversed(list(params)):
        nbytes = params[n].numel() * 4
        if cur and size + nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nbytes
    if cur:
        out.append(cur)
    return out


class Stepper(Protocol):
    """What the hooks need of the optimizer they serve (``DistributedOptimizer`` is one)."""

    @property
    def params(self) -> Mapping[str, torch.Tensor]:
        """The parameters pushed and pulled, by name, in the model's order."""
        ...

    @property
    def sync(self) -> SyncSpec:
        """The sync mode now (it can be switched live)."""
        ...

    @property
    def accumulator(self) -> Accumulator:
        """The ``every:X`` sums of the steps before this one."""
        ...

    def open_bucketed_push(self) -> BucketedPush:
        """This step's push, opened on every shard."""
        ...

    def synchronize(self) -> None:
        """Take in the pull in flight (``take_pull``); raises its failure."""
        ...


class Overlap:
    """The hooks and per-step state of an overlapping ``DistributedOptimizer`` (see the module docstring).

    It holds the step's pull in flight between ``step()`` (``coming``) and
    the optimizer taking it in (``take_pull``); the forward pre-hooks wait
    on it.
    """

    def __init__(self, opt: Stepper, model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.opt = opt
        self._pull: tuple[PullInFlight, float] | None = None  # the last step's weights, coming in; when started
        self.buckets = buckets(opt.params, bucket_bytes)
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b}
        self._stream: BucketedPush | None = None
        self._broken = False  # this step pushes whole at step()
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self.streamed_steps = 0  # steps whose gradient went up during backward
        self.whole_steps = 0  # steps where overlap stepped aside
        by_id = {id(p): n for n, p in opt.params.items()}
        self._handles: list[Any] = []
        for n, p in opt.params.items():
            hook = functools.partial(self._grad_ready, n)
            self._handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        for m in model.modules():
            own = [by_id[id(p)] for p in m.parameters(recurse=False) if id(p) in by_id]
            if own:
                self._handles.append(m.register_forward_pre_hook(functools.partial(self._weights_in, own)))

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the pull in flight ----------------------------------------------------

    def coming(self, pull: PullInFlight, started: float) -> None:
        """``pull`` (started at ``started``, ``time.perf_counter()``) brings the next forward's weights."""
        self._pull = (pull, started)

    @property
    def pull(self) -> PullInFlight | None:
        """The pull in flight (None: the weights are in, or no step yet)."""
        return self._pull[0] if self._pull is not None else None

    def take_pull(self) -> tuple[PullInFlight, float] | None:
        """The pull in flight and when it started, handed over (None then), for the optimizer to take in."""
        taken, self._pull = self._pull, None
        return taken

    # -- forward: wait for the module's own weights ---------------------------

    def _weights_in(self, names: list[str], module: nn.Module, args: Any) -> None:
        pull = self.pull
        if pull is not None:
            pull.wait(names)  # False: the pull failed; step() raises it (this forward's result is dropped)

    # -- backward: stream finished buckets ------------------------------------

    def _start(self) -> bool:
        """Open the step's push stream; False when this step cannot stream (the pull before it failed)."""
        opt = self.opt
        pull = self.pull
        if pull is not None:
            if not pull.wait(list(opt.params)):
                return False
            try:
                pull.result()
            except Exception:  # noqa: BLE001 - step() raises it again (synchronize), out of backward
                return False
            opt.synchronize()
        self._stream = opt.open_bucketed_push()
        return True

    def _grad_ready(self, name: str, param: torch.Tensor) -> None:
        if self._broken:
            return
        opt = self.opt
        x = opt.sync.accumulation
        if x > 1 and opt.accumulator.steps + 1 < x:  # not the step that pushes: step() sums it
            return
        if self._stream is None and not self._start():
            self._broken = True
            return
        stream = self._stream
        assert stream is not None
        k = self._bucket_of[name]
        pending = self._pending.setdefault(k, {})
        if name in pending or stream.handed_in(name):  # backward ran again in this step
            self._broken = True
            return
        grad = param.grad
        if grad is None:
            return
        pending[name] = self._value(name, grad)
        if len(pending) == len(self.buckets[k]):
            stream.add(self._pending.pop(k))

    def _value(self, name: str, grad: torch.Tensor | None) -> torch.Tensor:
        """What goes up for ``name``: its gradient, or under every:X the mean of the X steps' (as step())."""
        x = self.opt.sync.accumulation
        if x == 1:
            assert grad is not None
            return grad
        return self.opt.accumulator.mean_with(name, grad, x)

    # -- step() ------------------------------------------------------------------

    def take_stream(self) -> BucketedPush | None:
        """The step's open stream with every full or partial bucket in it; None when the step pushes
        whole (nothing streamed, or overlap stepped aside: any stream opened is cancelled)."""
        stream, broken = self._stream, self._broken
        self._stream, self._broken = None, False
        pending, self._pending = self._pending, {}
        if broken:
            if stream is not None:
                stream.abort()
            self.whole_steps += 1
            return None
        if stream is not None:
            for k in sorted(pending):
                stream.add(pending[k])
            self.streamed_steps += 1
        return stream

    def remaining(self, stream: BucketedPush) -> dict[str, torch.Tensor]:
        """Gradients not handed in during backward (parameters whose hook did not run)."""
        opt = self.opt
        out = {}
        for n, p in opt.params.items():
            if stream.handed_in(n):
                continue
            if p.grad is None and opt.accumulator.sum_of(n) is None:
                continue
            out[n] = self._value(n, p.grad)
        return out
