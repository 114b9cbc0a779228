"""``TPStepper``: a TP rank's parameter-server worker, pushing and pulling its slices of the whole tensors.

A ``DistributedOptimizer`` whose push and pull are of every parameter the rank holds (``local``): each split
one as its slice (``torch.chunk(t, p, dim)[rank]``: ``PushRequest.slices``, the shards put each slice in its
place and step the whole tensor once every slice of every replica is in, server/datapath/slicepush.py;
``PullRequest.slices``, the shards answer with the slice's elements only, server/datapath/slicepull.py), each
replicated one whole, pushed by its owner alone (``pushes``: those this rank owns) and pulled by every
rank. Its first registration is of the whole tensors this rank owns (``masters``: their values registered,
by replica 0; let go once registered); before its first pull the rank registers the whole model with no
values, which waits until every tensor's owner has registered it and gives the client the whole model's
layouts and shard map (a later rejoin registers so alone). A step's push asks for no weights in its answer
(they would be whole tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardps.protos.amp import LossScaling
from shardps.protos.slices import TensorSlice
from shardps.worker.client import PSClient, PushResult
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.datapath.slicepush import push_slices
from shardps.worker.job.jobview import JobView
from shardps.worker.layout import DEFAULT_MAX_WHOLE_BYTES
from shardps.worker.optimizer import DistributedOptimizer


class TPStepper(DistributedOptimizer):
    """See the module docstring. ``local``: every parameter this rank holds, by name (its slice for those in
    ``slices``); ``plan_over``: the whole model's tensors ("meta" ones do); the rest is
    ``DistributedOptimizer``'s, over ``masters``."""

    answers_with_weights = False

    def __init__(self, masters: Mapping[str, torch.Tensor], client: PSClient, *, local: Mapping[str, torch.Tensor],
                 slices: Mapping[str, TensorSlice], plan_over: Mapping[str, torch.Tensor], pushes: set[str],
                 **options: Any) -> None:
        if options.get("compress") is not None:
            raise ValueError("TPOptimizer: compress= is not supported: a TP rank pushes its slices uncompressed")
        self.local = dict(local)
        self.slices = dict(slices)
        self.plan_over = dict(plan_over)
        self.to_push = [n for n in self.local if n in slices or n in pushes]  # the split ones, the owned replicated
        self._options = options
        super().__init__(list(masters.items()), client, **options)
        # Registered: the whole values are let go. A later (re)join registers the whole model without values
        # (the tensors exist on the servers), which needs only the shapes.
        self.params = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
                       for n, p in self.params.items()}
        self._register = self._register_whole

    def _register_whole(self) -> None:
        """Every tensor of the model, without values: waits until their owners have registered them."""
        o = self._options
        scaling = o.get("loss_scaling", False)
        self.client.register(self.plan_over, self.optimizer, sync=str(self.sync), grad_dtype=o.get("grad_dtype"),
                             loss_scaling=LossScaling() if scaling is True else (scaling or None),
                             max_whole_bytes=o.get("max_whole_bytes", DEFAULT_MAX_WHOLE_BYTES),
                             staleness_remedy=o.get("staleness_remedy", "none"), provides_values=False)

    def _pull_all(self, min_versions: list[int] | None = None) -> None:
        if any(n not in self.client.layouts for n in self.local):  # joining: only the owned ones registered
            self._register_whole()
        self.pull_weights(min_versions=min_versions, inline=True).result()

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's slice of every split gradient (zeros for one without: every slice must come), and the
        whole gradients of the replicated parameters it owns."""
        return {n: g if (g := self.local[n].grad) is not None else torch.zeros_like(self.local[n])
                for n in self.to_push}

    def push_gradients(self, grads: dict[str, torch.Tensor], **options: Any) -> list[PushResult]:
        out = push_slices(self.client, grads, self.slices, options["step"], options["base_versions"],
                          loss_scale=options["loss_scale"], window=options["window"], then=options["then"])
        self.client.apply(JobView.of_push(out))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.local.values():
            p.grad = None

    def pull_weights(self, *, min_versions: list[int] | None = None, min_clock: int = 0,
                     answered: list[PushResult] | None = None, inline: bool = False,
                     later: bool = False) -> PullInFlight:
        """Every parameter of the rank: its slice of each split one, each replicated one whole."""
        c = self.client
        mins = list(min_versions) if min_versions is not None else [0] * c.num_shards
        pull = PullInFlight(c, list(self.local), out=self.local, min_versions=mins, dtype=self.pull_dtype,
                            min_clock=min_clock, on_result=c.apply, slices=self.slices)
        return pull.start_later() if later else pull.start(inline=inline)
