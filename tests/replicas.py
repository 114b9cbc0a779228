"""What the replication tests share: the workers' model, a training run in threads, equal state."""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardps
from shardps.server.store import ShardStore
from tests.helpers import run_workers

W = 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def big_model() -> nn.Module:
    """One weight of 2 MiB: its gradient travels to the backup in several Replicate messages."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 4))


def train(addresses, base, steps, *, sync="bsp", on_step=None, part_bytes=512, timeout=240, backups=None,
          shm=None, **opt_kw):
    """W workers in threads; each returns (its final parameters, its client's failovers). ``shm``: connect's
    (None: its default)."""

    def worker(k):
        model = copy.deepcopy(base)
        with shardps.connect(addresses, worker_id=k, num_workers=W, part_bytes=part_bytes,
                             recovery_timeout=60, backups=backups, shm=shm) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync,
                                               **opt_kw)
            for step in range(steps):
                g = torch.Generator().manual_seed(step * 10 + k)
                model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if on_step is not None:
                    on_step(k, step, client)
            return {n: p.detach().clone() for n, p in model.named_parameters()}, client.failovers_total
    return run_workers(worker, W, timeout=timeout)


def same_state(primary: ShardStore, backup: ShardStore) -> None:
    assert primary.state_hash() == backup.state_hash()
    p, b = primary.stats(), backup.stats()
    for key in ("version", "worker_clocks", "loss_scale", "sync", "evicted_workers", "gradients_applied_total",
                "skipped_steps_total", "staleness_counts", "epoch"):
        assert getattr(p, key) == getattr(b, key), key
